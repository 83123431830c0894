"""Text to token ids, the way the simulated engine does it, for the engine and the router.

* :mod:`~kvevents.text.tokenizer`: the byte-level tokenizer (one token per UTF-8 byte);
* :mod:`~kvevents.text.chat`: the chat template that renders OpenAI messages to text.

Both sides import these from here, so the router never depends on the engine package.
"""

from kvevents.text.chat import ChatError, render_chat
from kvevents.text.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "ChatError", "render_chat"]
