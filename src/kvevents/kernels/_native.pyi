from array import array

from typing_extensions import Buffer

ABI: int
MAX_BLOCK_TOKENS: int
MAX_TOP: int
CANDIDATE_BYTES: int
FRAGMENTS: int
ROW_STRIDE: int

class MaskMirror:
    def __init__(self, words: int = 1) -> None: ...
    @property
    def words(self) -> int: ...
    @property
    def count(self) -> int: ...
    @property
    def capacity(self) -> int: ...
    @property
    def grown(self) -> int: ...
    @property
    def rebuilds(self) -> int: ...
    def sync(self, keys: list[int], ops: Buffer, /) -> None: ...
    def rebuild(self, blocks: dict[int, int], /) -> None: ...
    def match(self, keys: Buffer, live: int, /) -> tuple[list[tuple[int, int]], int]: ...
    def not_held(self, keys: Buffer, slot: int, /) -> list[int]: ...
    def items(self) -> list[tuple[int, int]]: ...

def parse_input_ids(
    body: Buffer, lead: Buffer | None = None, /
) -> tuple[array[int], int] | None: ...
def chain_keys(tokens: Buffer, block_size: int, parent: int, /) -> array[int] | None: ...
def best_unmatched(
    slots: Buffer,
    table: Buffer,
    scale: float,
    n_blocks: float,
    load_weight: float,
    balance_weight: float,
    foreign_blocks: float,
    count: int,
    /,
) -> tuple[list[int], float]: ...
def route_answer(
    tokens: Buffer,
    block_size: int,
    parent: int,
    mirror: MaskMirror,
    live: int,
    plan: tuple[bytes, tuple[bytes, ...], float, float, float, bytes, float],
    top: int,
    predicted: MaskMirror | None,
    /,
) -> tuple[bytes | None, bytes, int]: ...
def query_answer(
    tokens: Buffer,
    block_size: int,
    parent: int,
    mirror: MaskMirror,
    live: int,
    plan: tuple[bytes, tuple[bytes, ...], bytes],
    predicted: MaskMirror | None,
    /,
) -> tuple[bytes, bytes, int]: ...
def board_choice(
    tokens: Buffer,
    block_size: int,
    parent: int,
    mirror: MaskMirror,
    live: int,
    board: Buffer,
    seats: bytes,
    scale: float,
    weights: tuple[float, float, float, float, float, float, float],
    predicted: MaskMirror | None,
    top: int,
    /,
) -> tuple[
    bytes,
    int,
    bool,
    tuple[tuple[int, int, float, float, float, float, float, float, float, bool, int], ...],
]: ...
def json_float(x: float, /) -> bytes | None: ...
def calls() -> dict[str, int]: ...
