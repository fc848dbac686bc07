"""What one engine rank announces about its KV cache at the handshake, so that two sides with
different tensor parallelism or block sizes can be mapped onto each other (issue 19).

Pure data, no torch and no vLLM: ``from_vllm`` builds a spec from an engine, ``mapping`` plans
how a producer cluster's ranks fill a consumer cluster's ranks, ``apply`` moves the tensors.

Every tensor-parallel split is described as a ``Sharded`` dimension: a number of whole units (KV
heads, linear-attention heads, Mamba groups) of ``unit_size`` elements each. A linear-attention conv
state concatenates several such dimensions (Gated DeltaNet: query-key, key, value; Mamba2: x, B, C),
and each is split on its own: a rank's conv state is its share of every component, in order.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import MISSING, asdict, dataclass, field, replace
from typing import Any, ClassVar, TypeVar

SPEC_VERSION = 1
T = TypeVar("T")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "int8": 1, "uint8": 1}
CONV_LAYOUTS = ("SD", "DS")  # vLLM's conv state orientation: (state_len, dim) or (dim, state_len)
# vLLM's CPU attention cache, [blocks, heads, block_size, 2 x head_size]: per (block, head) its K
# transposed ([head_size, block_size]), then its V ([block_size, head_size]) (``apply``)
CPU_K_TRANSPOSED = "cpu-k-transposed"
# vLLM's CPU ``amx`` kernel (bfloat16; csrc/cpu/cpu_attn_amx.hpp, its ``reshape_and_cache``): the same
# areas, packed for AMX tiles in groups of 16 tokens. Per (block, head), K as [block_size / 16,
# head_size / 2, 16, 2] (for each 16-token group, each channel pair: the 16 tokens' pairs side by
# side), then V as [head_size / 16, block_size / 2, 16, 2] (for each 16-channel group, each token
# pair: the 16 channels' pairs side by side) (``apply.tile_view``)
CPU_AMX = "cpu-amx"
# vLLM 0.32's GPU attention backends: [blocks, heads, block_size, 2 x head_size] logically (strided
# token-major LBNHC or head-major LBHNC, ``physical``), each token's K then V side by side, tokens in order
TOKEN_ROWS = "kv-token-rows"
SLICEABLE_LAYOUTS = (CPU_K_TRANSPOSED, CPU_AMX, TOKEN_ROWS)  # the layouts ``apply`` slices, re-blocks, converts
TILED_LAYOUTS = (CPU_AMX,)  # layouts whose tokens are written in groups of ``TILE_TOKENS`` (``apply.tile_view``)
TILE_TOKENS = 16
CPU_KERNEL_PREFIX = "cpu-"  # ``cpu-<isa>``: a CPU kernel whose layout is not mapped here (e.g. cpu-neon)
LAYOUT_KERNELS = {CPU_K_TRANSPOSED: "vLLM's CPU vec and vec16 kernels", CPU_AMX: "vLLM's CPU amx kernel",
                  TOKEN_ROWS: "vLLM's GPU backends"}


def describe_layout(cache_layout: str) -> str:
    """An announced ``cache_layout`` in words, naming the kernel it comes from (for refusals)."""
    if not cache_layout:
        return "unknown (none announced)"
    if cache_layout in LAYOUT_KERNELS:
        return f"{cache_layout} ({LAYOUT_KERNELS[cache_layout]})"
    if cache_layout.startswith(CPU_KERNEL_PREFIX):
        return f"{cache_layout} (vLLM's CPU {cache_layout.removeprefix(CPU_KERNEL_PREFIX)} kernel, not mapped here)"
    return f"{cache_layout} (not mapped here)"


@dataclass(frozen=True, slots=True)
class Sharded:
    """A dimension of ``num_units`` units of ``unit_size`` elements, split over TP ranks. vLLM gives
    rank r the r-th equal share when the ranks divide the units, and puts unit u on the
    ``tp_size / num_units`` consecutive ranks from ``u * tp_size / num_units`` when ranks outnumber
    units (replication). ``num_local_units`` is what the announcing rank holds."""
    name: str
    num_units: int
    unit_size: int
    num_local_units: int

    def __post_init__(self) -> None:
        _check(bool(self.name), "a sharded dimension needs a name")
        for key in ("num_units", "unit_size", "num_local_units"):
            _check(getattr(self, key) > 0, f"{self.name}: {key} must be positive, got {getattr(self, key)}")
        _check(self.num_local_units <= self.num_units,
               f"{self.name}: a rank cannot hold {self.num_local_units} of {self.num_units} units")

    @property
    def local_size(self) -> int:
        return self.num_local_units * self.unit_size

    @property
    def size(self) -> int:
        return self.num_units * self.unit_size

    def split_problem(self, tp_size: int) -> str | None:
        """Why this dimension is not split over ``tp_size`` ranks as vLLM splits it, or None."""
        if tp_size <= self.num_units and self.num_units % tp_size:
            return f"{self.num_units} {self.name} units do not divide over TP {tp_size}"
        if tp_size > self.num_units and tp_size % self.num_units:
            return f"TP {tp_size} is not a multiple of the {self.num_units} {self.name} units it replicates"
        expected = max(1, self.num_units // tp_size)
        if self.num_local_units != expected:
            return (f"{self.name}: a rank announces {self.num_local_units} of {self.num_units} units, "
                    f"vLLM holds {expected} at TP {tp_size}")
        return None

    def first_unit(self, rank: int, tp_size: int) -> int:
        if tp_size <= self.num_units:
            return rank * (self.num_units // tp_size)
        return rank // (tp_size // self.num_units)

    def holders(self, unit: int, tp_size: int) -> range:
        """The ranks that hold ``unit`` (several when it is replicated)."""
        if tp_size <= self.num_units:
            return range(unit // (self.num_units // tp_size), unit // (self.num_units // tp_size) + 1)
        copies = tp_size // self.num_units
        return range(unit * copies, (unit + 1) * copies)

    def same_shape(self, other: Sharded) -> bool:
        return (self.name, self.num_units, self.unit_size) == (other.name, other.num_units, other.unit_size)


@dataclass(frozen=True, slots=True)
class AttentionLayer:
    """A layer whose KV is paged per token: ``kv`` counts KV heads, ``unit_size`` is the head size;
    each head holds a K and a V vector per token."""
    kind: ClassVar[str] = "attention"
    name: str
    group: int
    kv: Sharded
    sliding_window: int | None = None

    @property
    def head_size(self) -> int:
        return self.kv.unit_size

    @property
    def parts(self) -> tuple[Sharded, ...]:
        return (self.kv,)


@dataclass(frozen=True, slots=True)
class LinearLayer:
    """A linear-attention layer (Gated DeltaNet, Mamba): one state page per request, holding the conv
    state (its components concatenated along the channel dim, ``conv_state_len`` positions) at byte 0
    and the temporal state (``temporal`` heads of shape ``temporal_head_shape``) right after it."""
    kind: ClassVar[str] = "linear"
    name: str
    group: int
    conv: tuple[Sharded, ...]
    conv_state_len: int
    temporal: Sharded
    temporal_head_shape: tuple[int, ...]
    conv_dtype: str
    temporal_dtype: str
    page_bytes: int
    conv_layout: str = "SD"

    def __post_init__(self) -> None:
        names = [part.name for part in self.parts]
        _check(bool(self.conv), f"{self.name}: a linear layer needs conv components")
        _check(len(set(names)) == len(names), f"{self.name}: part names repeat: {names}")
        _check(self.conv_state_len > 0, f"{self.name}: conv_state_len must be positive")
        _check(self.conv_layout in CONV_LAYOUTS, f"{self.name}: conv_layout {self.conv_layout!r} not in {CONV_LAYOUTS}")
        _check_dtype(self.conv_dtype)
        _check_dtype(self.temporal_dtype)
        _check(math.prod(self.temporal_head_shape) == self.temporal.unit_size,
               f"{self.name}: temporal head shape {self.temporal_head_shape} does not hold "
               f"{self.temporal.unit_size} elements")
        _check(self.page_bytes >= self.conv_bytes + self.temporal_bytes,
               f"{self.name}: page of {self.page_bytes} B cannot hold conv {self.conv_bytes} B "
               f"+ temporal {self.temporal_bytes} B")

    @property
    def parts(self) -> tuple[Sharded, ...]:
        return (*self.conv, self.temporal)

    @property
    def conv_dim(self) -> int:
        return sum(part.local_size for part in self.conv)

    @property
    def conv_bytes(self) -> int:
        return self.conv_dim * self.conv_state_len * DTYPE_BYTES[self.conv_dtype]

    @property
    def temporal_bytes(self) -> int:
        return self.temporal.local_size * DTYPE_BYTES[self.temporal_dtype]

    @property
    def conv_offsets(self) -> dict[str, int]:
        """Where each component starts in this rank's conv channel dim."""
        starts = [0]
        for part in self.conv:
            starts.append(starts[-1] + part.local_size)
        return {part.name: start for part, start in zip(self.conv, starts)}


Layer = AttentionLayer | LinearLayer


@dataclass(frozen=True, slots=True)
class LayoutSpec:
    """One rank's KV layout: layers in registration order, each naming its KV-cache group; block
    sizes per group (tokens per block for attention groups). ``cache_layout`` names the attention
    cache's memory layout where the announcing side knows it (``CPU_K_TRANSPOSED``, ``CPU_AMX``,
    ``TOKEN_ROWS``), the kernel where it does not (``cpu-<isa>``), ``""`` unknown."""
    model: str
    dtype: str
    tp_rank: int
    tp_size: int
    block_sizes: tuple[int, ...]
    layers: tuple[Layer, ...] = field(default=())
    cache_layout: str = ""

    def __post_init__(self) -> None:
        _check(bool(self.model), "the model key is empty")
        _check_dtype(self.dtype)
        _check(0 <= self.tp_rank < self.tp_size, f"TP rank {self.tp_rank} is not in [0, {self.tp_size})")
        _check(all(size > 0 for size in self.block_sizes), f"block sizes must be positive: {self.block_sizes}")
        names = [layer.name for layer in self.layers]
        _check(len(set(names)) == len(names), "layer names repeat")
        for layer in self.layers:
            _check(0 <= layer.group < len(self.block_sizes),
                   f"layer {layer.name}: group {layer.group} has no block size ({len(self.block_sizes)} groups)")

    def for_rank(self, tp_rank: int) -> LayoutSpec:
        return replace(self, tp_rank=tp_rank)

    def at_tp(self, tp_size: int, tp_rank: int = 0) -> LayoutSpec:
        """The same model's layout on a rank of an engine with ``tp_size`` ranks, as far as mapping
        needs it (units per rank; a state page at least its states): what a producer plans a send to
        a consumer of another TP size with. Raises ``ValueError`` where a dimension does not split."""
        def shard(part: Sharded) -> Sharded:
            local = replace(part, num_local_units=max(1, part.num_units // tp_size))
            if problem := local.split_problem(tp_size):
                raise ValueError(problem)
            return local

        def layer_at(layer: Layer) -> Layer:
            if isinstance(layer, AttentionLayer):
                return replace(layer, kv=shard(layer.kv))
            conv, temporal = tuple(shard(part) for part in layer.conv), shard(layer.temporal)
            states = (sum(part.local_size for part in conv) * layer.conv_state_len * DTYPE_BYTES[layer.conv_dtype]
                      + temporal.local_size * DTYPE_BYTES[layer.temporal_dtype])
            return replace(layer, conv=conv, temporal=temporal, page_bytes=max(layer.page_bytes, states))

        return replace(self, tp_rank=tp_rank, tp_size=tp_size, layers=tuple(layer_at(layer) for layer in self.layers))

    def to_bytes(self) -> bytes:
        data = asdict(self)
        for layer, encoded in zip(self.layers, data["layers"]):
            encoded["kind"] = layer.kind
        return json.dumps({"version": SPEC_VERSION, **data}, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, payload: bytes) -> LayoutSpec:
        try:
            data = json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"layout spec is not JSON: {error}") from None
        _check(isinstance(data, dict), "layout spec is not a JSON object")
        version = data.pop("version", None)
        _check(version == SPEC_VERSION, f"layout spec version {version!r}, this side reads {SPEC_VERSION}")
        data["layers"] = tuple(_decode_layer(item) for item in _list(data.get("layers"), "layers"))
        return _decode(cls, data)


def _decode_layer(data: Any) -> Layer:
    _check(isinstance(data, dict), f"a layer is {type(data).__name__}, not an object")
    kind = data.pop("kind", None)
    if kind == AttentionLayer.kind:
        data["kv"] = _decode(Sharded, data.get("kv"))
        return _decode(AttentionLayer, data)
    if kind == LinearLayer.kind:
        data["conv"] = tuple(_decode(Sharded, item) for item in _list(data.get("conv"), "conv"))
        data["temporal"] = _decode(Sharded, data.get("temporal"))
        return _decode(LinearLayer, data)
    raise ValueError(f"layer kind {kind!r} is not one of {AttentionLayer.kind!r}, {LinearLayer.kind!r}")


_TYPES: dict[str, Any] = {"int": int, "str": str, "int | None": (int, type(None)), "tuple[int, ...]": tuple}


def _decode(cls: type[T], data: Any) -> T:
    """Build ``cls`` from a JSON object, naming the first missing, unknown or mistyped field."""
    where = cls.__name__
    _check(isinstance(data, dict), f"{where} is {type(data).__name__}, not an object")
    fields = {spec.name: str(spec.type) for spec in dataclasses.fields(cls)}  # type: ignore[arg-type]
    missing = [spec.name for spec in dataclasses.fields(cls)  # type: ignore[arg-type]
               if spec.name not in data and spec.default is MISSING and spec.default_factory is MISSING]
    unknown = [name for name in data if name not in fields]
    _check(not missing, f"{where}: missing field(s) {missing}")
    _check(not unknown, f"{where}: unknown field(s) {unknown}")
    for name, value in data.items():
        expected = _TYPES.get(fields[name])
        if expected is tuple:
            _check(isinstance(value, list) and all(type(item) is int for item in value),
                   f"{where}.{name}: {value!r} is not a list of integers")
            data[name] = tuple(value)
        elif expected is not None:
            _check(isinstance(value, expected) and type(value) is not bool,
                   f"{where}.{name}: {value!r} is not {fields[name]}")
    return cls(**data)


def _list(value: Any, name: str) -> list[Any]:
    _check(isinstance(value, (list, tuple)), f"{name}: {value!r} is not a list")
    return list(value)


def _check_dtype(dtype: str) -> None:
    _check(dtype in DTYPE_BYTES, f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)
