from typing_extensions import Buffer

ABI: int
MAX_BLOCK_TOKENS: int
MAX_TOP: int
CANDIDATE_BYTES: int
FRAGMENTS: int

def route_answer(
    tokens: Buffer,
    block_size: int,
    parent: int,
    table_keys: Buffer,
    table_values: Buffer,
    live: int,
    plan: tuple[bytes, tuple[bytes, ...], float, float, float, bytes, float],
    top: int,
    predicted_keys: Buffer | None,
    predicted_values: Buffer | None,
    /,
) -> tuple[bytes | None, bytes, int]: ...
def query_answer(
    tokens: Buffer,
    block_size: int,
    parent: int,
    table_keys: Buffer,
    table_values: Buffer,
    live: int,
    plan: tuple[bytes, tuple[bytes, ...], bytes],
    predicted_keys: Buffer | None,
    predicted_values: Buffer | None,
    /,
) -> tuple[bytes, bytes, int]: ...
def board_choice(
    tokens: Buffer,
    block_size: int,
    parent: int,
    table_keys: Buffer,
    table_values: Buffer,
    live: int,
    board: Buffer,
    seats: bytes,
    scale: float,
    weights: tuple[float, float, float, float, float, float, float],
    predicted_keys: Buffer | None,
    predicted_values: Buffer | None,
    top: int,
    /,
) -> tuple[
    bytes,
    int,
    bool,
    tuple[tuple[int, int, float, float, float, float, float, float, float, bool, int], ...],
]: ...
def chain_keys(tokens: Buffer, block_size: int, parent: int, /) -> bytes: ...
def json_float(x: float, /) -> bytes | None: ...
