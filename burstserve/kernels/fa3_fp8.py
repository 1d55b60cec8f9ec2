"""FP8 attention for prefill (`--attention-backend fa3-fp8`): FlashAttention-3's Hopper forward on e4m3
operands (the `fa3-fwd` package, `import fa3_fwd_interface`), and the same arithmetic in torch where that
kernel is not (the CPU, and the tests' yardstick).

    fa3_fp8_attention(q, k, v, causal, scale) -> (out [Sq, H, D] in q's dtype, lse [Sq, H] fp32, natural log)

q [Sq, H, D], k and v [Sk, Hkv, D] (H % Hkv == 0); `causal` aligned to the end (query i sees keys 0 .. Sk - Sq
+ i), which is top-left on the square blocks the AttentionBackend contract uses it on.

The arithmetic (FlashAttention-3's, the kernel's own: hopper/softmax.h, mainloop_fwd_sm90_tma_gmma_ws.hpp):
- q and k first turned by one rotation R = diag(signs) H (H Sylvester's Hadamard matrix of order D, entries
  +-1, exact in any dtype; R R^T = D I, so q R . k R = D q . k, the D folded into the softmax scale), in q's
  dtype, inside the casts below (the turned values never written); where D is not a power of two, not turned.
  A trained model's q . k is carried by a few channels; under one scale a head their elements are rounded like
  any other (e4m3 keeps 3 bits), and that rounding is the error. Turned, every channel of q R and k R carries
  a share of them, their errors independent, and the dot product's error shrinks with the square root of D;
- q, k and v each cast to e4m3 with one scale per KV head for the whole call, amax / 448 (q's over the query
  heads of the group: FA3's descales are [batch, KV heads] for all three);
- S = q8 . k8 in fp32 times q's and k's descales and the softmax scale; P = exp(S - running row max) * 2^8
  (FA3's Max_offset: P in [0, 256], far from e4m3's subnormals), cast to e4m3; P8 . v8, times v's descale,
  over the row sum of the unrounded P;
- the keys in segments of at most KEY_SEGMENT a call, the partials merged by their LSE (kernels.merge): a
  segment bounds the P . V accumulation that Hopper's FP8 tensor cores carry at reduced precision along a
  call, which drifts with the number of keys (docs/benchmarks.md, FP8 attention).
The torch path takes the row maximum over the segment's keys, not the running maximum of FA3's tiles: P is
never larger than the kernel's, so its e4m3 rounding is never finer (a bound on the kernel's error, and equal
to it where a row's maximum is in its first tile).
"""
import functools
import os

import torch

from burstserve.kernels.arith import ceil_div, next_pow2
from burstserve.kernels.kv_quant import FP8, FP8_MAX
from burstserve.kernels.merge import merge_into
from burstserve.kernels.triton_setup import LazyTriton, bf16_by_bits, e4m3_by_arithmetic

KEY_SEGMENT = 131072         # keys a kernel call at most; longer key ranges in segments merged by LSE
P_OFFSET = 256.0             # FA3's 2^Max_offset for FP8
MIN_SCALE = 2.0 ** -126
QUERY_CHUNK = 1024           # the torch path's query rows at a time (no [Sq, Sk] score matrix whole)
CAST_ROWS = 16384            # rows the torch path casts to e4m3 at a time

FP8_ATTENTION_EXTRA = "fa3-fwd (pip install 'burstserve[fp8-attention]')"

tl = None                    # triton.language, bound by _build (the kernels resolve it as a global)
_e4m3 = _bf16 = None         # the interpreter's e4m3 rounding (kernels.triton_setup), bound by _build


# ---------------------------------------------------------------- operands

def to_e4m3(x: torch.Tensor, num_kv_heads: int, turn: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [S, Hx, D] (Hx a multiple of num_kv_heads; rows of any stride, each row's heads contiguous) -> (x8 [S,
    Hx, D] e4m3, descale [Hkv] fp32): each head's row turned by `turn` [D, D] first when given (x @ turn, summed
    in fp32 and rounded to x's dtype, never written: the rotation of the module docstring), then one scale per
    KV head (its group of heads), amax / 448, each value divided by it (rounded to nearest), clamped to +-448,
    rounded to nearest even. On CUDA two Triton kernels (the group maxima, then the cast: one read of x each);
    elsewhere, or after a kernel failed, torch, CAST_ROWS rows at a time."""
    kern = _triton.kernels(x.device)
    if kern is not None and x.shape[0] > 0 and _rows_ok(x) and _turn_ok(x, turn):
        try:
            return _to_e4m3_triton(kern, x, num_kv_heads, turn)
        except Exception as e:      # compile or launch failure: the torch ops from now on
            _triton.failed(e)
    return _to_e4m3_torch(x, num_kv_heads, turn)


def _to_e4m3_torch(x: torch.Tensor, num_kv_heads: int, turn: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """to_e4m3 in torch ops, CAST_ROWS rows at a time (small fp32 temporaries)."""
    s, hx, d = x.shape
    def values(a: int) -> torch.Tensor:                                                # [c, Hkv, g * D] fp32
        v = x[a:a + CAST_ROWS]
        v = (v @ turn).float() if turn is not None else v.float()                      # turned in x's dtype
        return v.reshape(v.shape[0], num_kv_heads, (hx // num_kv_heads) * d)

    amax = torch.zeros(num_kv_heads, dtype=torch.float32, device=x.device)
    for a in range(0, s, CAST_ROWS):
        amax = torch.maximum(amax, values(a).abs().amax(dim=(0, 2)))
    # a true division (torch on CUDA multiplies by the inverse for a divisor given as a number), as the kernels'
    descale = (amax / torch.full_like(amax, FP8_MAX)).clamp(min=MIN_SCALE)            # [Hkv]
    x8 = torch.empty(s, num_kv_heads, (hx // num_kv_heads) * d, dtype=FP8, device=x.device)
    for a in range(0, s, CAST_ROWS):
        x8[a:a + CAST_ROWS] = (values(a) / descale[None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    return x8.view(s, hx, d), descale


def _rows_ok(x: torch.Tensor) -> bool:
    """Rows the cast kernels read: a row's Hx * D values contiguous (the row stride free)."""
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _turn_ok(x: torch.Tensor, turn: torch.Tensor | None) -> bool:
    """A rotation the kernels apply (tl.dot): [D, D] in x's dtype, D a power of two of at least 16."""
    d = x.shape[-1]
    return turn is None or (turn.shape == (d, d) and turn.dtype == x.dtype and d >= 16 and d & (d - 1) == 0)


def _to_e4m3_triton(kern: dict, x: torch.Tensor, num_kv_heads: int, turn: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    s, hx, d = x.shape
    if hx % num_kv_heads:
        raise ValueError(f"{hx} heads do not split into {num_kv_heads} KV-head groups")
    g = hx // num_kv_heads                                                             # heads a group
    gpad, dpad = next_pow2(g), next_pow2(d)
    rotate = turn is not None
    rows = max(1, CAST_TILE // (gpad * dpad), ceil_div(16, gpad) if rotate else 1)    # (tl.dot: 16 lines at least)
    blocks = ceil_div(s, rows)
    grid = (min(blocks, max(1, _programs(x.device) // num_kv_heads)), num_kv_heads)
    launch = dict(G=g, GPAD=gpad, D=d, DPAD=dpad, ROWS=rows, ROTATE=rotate,
                  INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1")
    amax_bits = torch.zeros(num_kv_heads, dtype=torch.int32, device=x.device)          # fp32 >= 0 as int32 bits
    turn_arg = turn if rotate else x                                                    # (unread without ROTATE)
    kern["amax"][grid](x, turn_arg, amax_bits, s, x.stride(0), blocks, num_stages=CAST_STAGES, **launch)
    descale = torch.empty(num_kv_heads, dtype=torch.float32, device=x.device)
    x8 = torch.empty(s, hx, d, dtype=FP8, device=x.device)
    kern["cast"][grid](x, turn_arg, amax_bits, descale, x8.view(torch.uint8), s, x.stride(0), blocks, MIN_SCALE,
                       num_stages=CAST_STAGES, **launch)
    return x8, descale


CAST_TILE = 8192             # values a loop step of the cast kernels takes (rows of one group's heads)
PROGRAMS_PER_SM = 4          # the cast kernels' programs (all groups), each looping over row blocks
INTERPRETED_PROGRAMS = 2     # the same under the CPU interpreter: a program takes several blocks
CAST_STAGES = 1              # no software pipeline: each program's loads go straight to registers (3 stages, Triton's
                             # default on Hopper, took 17% longer at 8K: docs/results/log.md, "One division less")


@functools.lru_cache(maxsize=None)
def _programs(device: torch.device) -> int:
    """The cast kernels' programs on this device, over all KV-head groups."""
    if device.type != "cuda":
        return INTERPRETED_PROGRAMS
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def _build() -> dict:
    """jit the two cast kernels. A fresh set each call: tests build interpreted ones (TRITON_INTERPRET=1)."""
    global tl, _e4m3, _bf16, _group_tile, _load_turn, _divisor_parts, _divide
    import triton
    import triton.language as tl
    _e4m3, _bf16 = e4m3_by_arithmetic(), bf16_by_bits()

    def group_tile(x_ptr, turn, block, s, row_stride, G: tl.constexpr, GPAD: tl.constexpr, D: tl.constexpr,
                   DPAD: tl.constexpr, ROWS: tl.constexpr, ROTATE: tl.constexpr, INTERPRETED: tl.constexpr):
        """Row block `block` of group program_id(1)'s values as fp32 [ROWS * GPAD, DPAD] (a head's row of D a line;
        0 past the tensor, the group and D), turned (x @ turn, fp32 sums rounded to x's dtype) under ROTATE ->
        (values, in range [.., DPAD], the lines' rows [ROWS * GPAD], heads [ROWS * GPAD], columns [DPAD])."""
        i = tl.arange(0, ROWS * GPAD)
        r = (block * ROWS + i // GPAD).to(tl.int64)                                  # (rows < 2^31)
        head = tl.program_id(1) * G + i % GPAD
        c = tl.arange(0, DPAD)
        ok = ((r < s) & (i % GPAD < G))[:, None] & (c[None, :] < D)
        x = tl.load(x_ptr + r[:, None] * row_stride + head[:, None] * D + c[None, :], mask=ok, other=0.0)
        if ROTATE:          # D == DPAD: each line times the [D, D] rotation, exact products summed in fp32
            if x.dtype == tl.float32 or INTERPRETED:     # the interpreter's bf16 tl.dot is wrong: fp32 there
                y = tl.dot(x.to(tl.float32), turn.to(tl.float32), input_precision="ieee")
            else:
                y = tl.dot(x, turn)
            if INTERPRETED and x.dtype == tl.bfloat16:   # the interpreter's fp32 -> bf16 cast: not nearest even
                y = _bf16(y)
            else:
                y = y.to(x.dtype).to(tl.float32)         # rounded to x's dtype, as x @ turn (cuBLAS) rounds it
        else:
            y = x.to(tl.float32)
        return y, ok, r, head, c

    def load_turn(turn_ptr, D: tl.constexpr, DPAD: tl.constexpr, ROTATE: tl.constexpr):
        """The [D, D] rotation, read once a program (0 without ROTATE: never used)."""
        if ROTATE:
            c = tl.arange(0, DPAD)
            return tl.load(turn_ptr + c[:, None] * D + c[None, :])
        else:
            return 0.0

    def divisor_parts(d):
        """A divisor d (fp32 scalar) -> (1 / d, its power of two s with d s in [1, 2), -d s, 1 / (d s)), each rounded
        to nearest: what divide needs for x / d exactly rounded. The GPU's division (div.rn) takes a reciprocal,
        FMAs and a check for the cases they miss, each value: here the reciprocal is taken once, and two FMAs a
        value correct x (1 / d) to the nearest quotient (Markstein's correction; x and d shifted by s, so that
        the remainder stays out of the subnormals for every quotient e4m3 does not round to 0). A d that is not
        finite -> (1 / d, 1, 0, 0): divide then gives x (1 / d), which is x / d there (0, or NaN)."""
        bits = d.to(tl.int32, bitcast=True)
        finite = (bits & 0x7F800000) != 0x7F800000
        # 2^(127 - e) for d's exponent field e (d >= 2^-126 and d <= fp32's largest / 448: in range)
        shift = tl.where(finite, ((254 - ((bits >> 23) & 0xFF)) << 23).to(tl.float32, bitcast=True), 1.0)
        shifted = tl.where(finite, d * shift, 1.0)                                     # exact: in [1, 2)
        return tl.div_rn(1.0, d), shift, tl.where(finite, -shifted, 0.0), tl.where(finite, tl.div_rn(1.0, shifted), 0.0)

    def divide(x, inv, shift, neg_shifted, shifted_inv):
        """x / d rounded to nearest from divisor_parts(d): q = x (1 / d) is within an ulp or so; the remainder
        x s - q (d s) is exact by one FMA; q + remainder / (d s) by another. A zero q (x = +-0, or a quotient far
        below e4m3's subnormals) is kept as it is: it has x's sign, which the sums would not keep for -0."""
        q = x * inv
        rem = tl.fma(q, neg_shifted, x * shift)
        return tl.where(q == 0, q, tl.fma(rem, shifted_inv, q))

    def amax_kernel(x_ptr, turn_ptr, amax_ptr, s, row_stride, blocks, G: tl.constexpr, GPAD: tl.constexpr,
                    D: tl.constexpr, DPAD: tl.constexpr, ROWS: tl.constexpr, ROTATE: tl.constexpr,
                    INTERPRETED: tl.constexpr):
        """Program (p, group g), over row blocks p, p + P, ..: the largest |value|, into amax[g] by an atomic max
        of the fp32's bits with the sign cleared (their order is the values', with inf above every finite value
        and NaN above inf: a NaN or inf in x reaches the scale, as in torch's amax)."""
        turn = _load_turn(turn_ptr, D, DPAD, ROTATE)
        best = tl.zeros([ROWS * GPAD], tl.int32)
        for block in range(tl.program_id(0), blocks, tl.num_programs(0)):
            y, ok, r, head, c = _group_tile(x_ptr, turn, block, s, row_stride, G, GPAD, D, DPAD, ROWS, ROTATE,
                                            INTERPRETED)
            bits = tl.where(ok, y.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)          # |value| as bits
            best = tl.maximum(best, tl.max(bits, axis=1))
        tl.atomic_max(amax_ptr + tl.program_id(1), tl.max(best, axis=0))

    def cast_kernel(x_ptr, turn_ptr, amax_ptr, descale_ptr, out_ptr, s, row_stride, blocks, min_scale,
                    G: tl.constexpr, GPAD: tl.constexpr, D: tl.constexpr, DPAD: tl.constexpr, ROWS: tl.constexpr,
                    ROTATE: tl.constexpr, INTERPRETED: tl.constexpr):
        """Program (p, group g), over row blocks p, p + P, ..: descale = max(amax[g] / 448, min_scale) (NaN
        kept; program 0 stores it), value / descale (rounded to nearest, as torch's division; by two FMAs, see
        divisor_parts), clamped to +-448,
        to e4m3 (nearest even), stored as bytes into the contiguous out [S, Hx, D]."""
        g = tl.program_id(1)
        raw = tl.div_rn(tl.load(amax_ptr + g).to(tl.float32, bitcast=True), 448.0)
        descale = tl.where(raw < min_scale, min_scale, raw)                              # a NaN stays NaN
        if tl.program_id(0) == 0:
            tl.store(descale_ptr + g, descale)
        turn = _load_turn(turn_ptr, D, DPAD, ROTATE)
        inv, shift, neg_shifted, shifted_inv = _divisor_parts(descale)
        heads = tl.num_programs(1) * G
        for block in range(tl.program_id(0), blocks, tl.num_programs(0)):
            y, ok, r, head, c = _group_tile(x_ptr, turn, block, s, row_stride, G, GPAD, D, DPAD, ROWS, ROTATE,
                                            INTERPRETED)
            y = _divide(y, inv, shift, neg_shifted, shifted_inv)
            y8 = tl.minimum(tl.maximum(y, -448.0), 448.0)    # min / max drop a NaN: it is stored apart
            if INTERPRETED:     # the interpreter's fp32 -> e4m3 cast drops the carry into the exponent
                y8 = _e4m3(y8)
            q8 = tl.where(y == y, y8.to(tl.float8e4nv).to(tl.uint8, bitcast=True), 0x7F)   # 0x7F: e4m3's NaN
            tl.store(out_ptr + r[:, None] * (heads * D) + head[:, None] * D + c[None, :], q8, mask=ok)

    _group_tile, _load_turn = triton.jit(group_tile), triton.jit(load_turn)
    _divisor_parts, _divide = triton.jit(divisor_parts), triton.jit(divide)
    # the lengths not specialized: a prompt of a new length compiles nothing (the strides, which decide the loads'
    # width, are the model's)
    nospec = ["s", "blocks"]
    return {"amax": triton.jit(amax_kernel, do_not_specialize=nospec),
            "cast": triton.jit(cast_kernel, do_not_specialize=nospec)}


_triton = LazyTriton(_build, "fa3-fp8 casts")
_group_tile = _load_turn = _divisor_parts = _divide = None   # the kernels' helpers, jitted by _build (globals)


# ---------------------------------------------------------------- one call on e4m3 operands

def _fa3_call(q8, k8, v8, qd, kd, vd, causal: bool, scale: float):
    """FlashAttention-3's FP8 forward: (out [Sq, H, D] bf16, lse [Sq, H] fp32)."""
    res = _fa3_module().flash_attn_func(q8[None], k8[None], v8[None], softmax_scale=scale, causal=causal,
                                        q_descale=qd[None], k_descale=kd[None], v_descale=vd[None],
                                        return_attn_probs=True)
    out, lse = res[0], res[1]                                                          # [1, Sq, H, D], [1, H, Sq]
    return out[0], lse[0].transpose(0, 1)


def _torch_call(q8, k8, v8, qd, kd, vd, causal: bool, scale: float):
    """The same arithmetic in torch, fp32: (out [Sq, H, D] bf16, lse [Sq, H] fp32). Rows that see no key give
    out 0, lse -inf."""
    sq, h, d = q8.shape
    sk, hkv, _ = k8.shape
    g = h // hkv
    kf, vf = k8.float(), v8.float()                                                    # exact
    score_scale = (qd * kd * scale)[:, None, None, None]                               # [Hkv, 1, 1, 1]
    out = torch.empty(sq, h, v8.shape[-1], dtype=torch.float32, device=q8.device)
    lse = torch.empty(sq, h, dtype=torch.float32, device=q8.device)
    for a in range(0, sq, QUERY_CHUNK):
        b = min(a + QUERY_CHUNK, sq)
        qc = q8[a:b].float().view(b - a, hkv, g, d)                                    # [c, Hkv, g, D]
        s = torch.einsum("qhgd,khd->hgqk", qc, kf) * score_scale                       # [Hkv, g, c, Sk]
        if causal:
            rows = torch.arange(a, b, device=q8.device) + (sk - sq)
            s.masked_fill_(torch.arange(sk, device=q8.device)[None, :] > rows[:, None], float("-inf"))
        row_max = s.amax(dim=-1, keepdim=True)                                         # [Hkv, g, c, 1]
        seen = torch.isfinite(row_max)
        p = torch.exp(s - torch.where(seen, row_max, 0.0))                             # P in [0, 1]
        total = p.sum(dim=-1, keepdim=True)                                            # unrounded, fp32
        p8 = (p * P_OFFSET).to(FP8).float()                                            # as the kernel rounds P
        o = torch.einsum("hgqk,khd->qhgd", p8, vf)                                     # [c, Hkv, g, D]
        o = o * vd[None, :, None, None] / (P_OFFSET * total.permute(2, 0, 1, 3).clamp(min=1e-30))
        o = torch.where(seen.permute(2, 0, 1, 3), o, 0.0)
        out[a:b] = o.reshape(b - a, h, -1)
        ls = (row_max + torch.log(total)).squeeze(-1)                                  # [Hkv, g, c]
        lse[a:b] = torch.where(seen.squeeze(-1), ls, float("-inf")).reshape(h, b - a).transpose(0, 1)
    return out.to(torch.bfloat16), lse


# ---------------------------------------------------------------- the backend

def fa3_fp8_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                      segment: int = KEY_SEGMENT, kernel: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring. kernel: auto (FA3 on CUDA, torch elsewhere) | fa3 | torch."""
    hkv = k.shape[1]
    call = _fa3_call if kernel == "fa3" or (kernel == "auto" and q.is_cuda) else _torch_call
    turn = rotation(q.shape[-1], q.dtype, q.device)                                    # [D, D] or None
    if turn is not None:
        scale = scale / q.shape[-1]                                                    # q R . k R = D q . k
    (q8, qd), (k8, kd), (v8, vd) = to_e4m3(q, hkv, turn), to_e4m3(k, hkv, turn), to_e4m3(v, hkv)
    out, lse = run_segments(lambda a, b, c, masked: call(a, b, c, qd, kd, vd, masked, scale), q8, k8, v8,
                            causal, segment)
    return out.to(q.dtype), lse


def run_segments(call, q, k, v, causal: bool, segment: int) -> tuple[torch.Tensor, torch.Tensor]:
    """call(q rows, k rows, v rows, causal) -> (out, lse) over each of segments(...)'s pieces, merged by LSE
    in fp32 (kernels.merge; a bf16 accumulator's rounding at every merge costs more than FP8's own error at
    a million keys in 32 segments) -> (out [Sq, H, D] fp32, or the one call's own; lse [Sq, H] fp32)."""
    pieces = list(segments(q.shape[0], k.shape[0], causal, segment))
    if len(pieces) == 1:
        return call(q, k, v, causal)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    for q0, q1, k0, k1, masked in pieces:
        o, s = call(q[q0:q1], k[k0:k1], v[k0:k1], masked)
        merge_into(out[q0:q1], lse[q0:q1], o, s)
    return out, lse


def segments(sq: int, sk: int, causal: bool, segment: int):
    """The kernel calls of one attention call -> (query rows q0:q1, keys k0:k1, causal) each. The keys are cut
    at every multiple of `segment`. Under a causal mask (end-aligned: query r sees
    keys up to r + sk - sq) a range that ends the keys is one end-aligned call from its first row that sees
    it; a range before the square of the last sq keys is seen whole by every row; a range inside the square
    is a square for its own rows and seen whole by the rows after them (and one across the square's start is
    cut there). Rows that see no key of a range are in no call of it."""
    off = sk - sq if causal else sk                 # keys before the square (all of them when not causal)
    cuts = sorted(set(range(0, sk, segment)) | {sk})
    for k0, k1 in zip(cuts[:-1], cuts[1:]):
        if k1 <= off:
            yield 0, sq, k0, k1, False
        elif k1 == sk:
            yield max(0, k0 - off), sq, k0, k1, True
        else:
            if k0 < off:
                yield 0, sq, k0, off, False
                k0 = off
            yield max(0, k0 - off), k1 - off, max(k0, off), k1, True
            yield k1 - off, sq, max(k0, off), k1, False


@functools.lru_cache(maxsize=None)
def rotation(d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """[D, D]: diag(signs) times Sylvester's Hadamard matrix of order D (entries +-1; R R^T = D I); the signs
    drawn once from a fixed seed, the same on every worker. None where D is not a power of two."""
    if d & (d - 1):
        return None
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(ROTATION_SEED)) * 2 - 1
    return (signs[:, None] * h).to(dtype=dtype, device=device)


ROTATION_SEED = 0


@functools.lru_cache(maxsize=None)
def _fa3_module():
    import fa3_fwd_interface
    return fa3_fwd_interface


def fa3_fp8_refusal(device: torch.device) -> str | None:
    """Why FA3's FP8 forward cannot run on this device (None: it can; the CPU runs the torch path)."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"--attention-backend fa3-fp8 needs a Hopper GPU (sm_90); {device} is sm_{major}{minor}"
    try:
        _fa3_module()
    except Exception as e:  # ImportError, or a build that does not load under this torch
        return f"--attention-backend fa3-fp8 needs {FP8_ATTENTION_EXTRA}, which does not import here: {e}"
    return None
