import mlx.core as mx

def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    *,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array: ...
def quantized_matmuls(
    x: mx.array,
    w: list[mx.array],
    scales: list[mx.array],
    biases: list[mx.array],
    group_size: int,
    bits: int,
    *,
    stream: mx.Stream | mx.Device | None = None,
) -> list[mx.array]: ...
def attend(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    positions: mx.array,
    buffers: list[mx.array],
    rows: list[int],
    scale: float,
    *,
    inv_freq: mx.array | None = None,
    rope_dims: int = 0,
    rope_traditional: bool = False,
    rope_scale: float = 1.0,
    stream: mx.Stream | mx.Device | None = None,
) -> list[mx.array]: ...
def decoder_layer(
    h: mx.array,
    input_norm: mx.array,
    post_norm: mx.array,
    eps: float,
    weights: list[mx.array],
    bits: list[int],
    group_sizes: list[int],
    head_norms: list[mx.array],
    positions: mx.array,
    buffers: list[mx.array],
    rows: list[int],
    scale: float,
    *,
    inv_freq: mx.array | None = None,
    rope_dims: int = 0,
    rope_traditional: bool = False,
    rope_scale: float = 1.0,
    low_ranks: list[mx.array] = ...,
    low_rank_products: list[int] = ...,
    low_rank_scales: list[float] = ...,
    low_rank_rows: list[list[int]] = ...,
    stream: mx.Stream | mx.Device | None = None,
) -> list[mx.array]: ...
def low_rank(
    y: mx.array,
    x: mx.array,
    a_t: list[mx.array],
    b: list[mx.array],
    scales: list[float],
    rows: list[list[int]],
    *,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array: ...
def swiglu(gate: mx.array, up: mx.array, *, stream: mx.Stream | mx.Device | None = None) -> mx.array: ...
def geglu(gate: mx.array, up: mx.array, *, stream: mx.Stream | mx.Device | None = None) -> mx.array: ...
def rms_norm(x: mx.array, weight: mx.array, eps: float, *, stream: mx.Stream | mx.Device | None = None) -> mx.array: ...
def log_softmax(x: mx.array, *, stream: mx.Stream | mx.Device | None = None) -> mx.array: ...
def sample(
    x: mx.array,
    words: mx.array,
    *,
    inv_temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array: ...
def num_threads() -> int: ...
def set_num_threads(n: int) -> None: ...
def isa() -> str: ...
def best_isa() -> str: ...
def set_isa(name: str) -> None: ...
