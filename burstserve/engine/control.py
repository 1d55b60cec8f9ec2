"""How worker 0 tells the other workers what to run: the control plane (the data plane is NCCL / gloo).

Every call is one message (engine/core/calls.py), pickled once by worker 0 and run by every worker in the same
order. Two ways to carry it:
- `PipeControl` (every worker on worker 0's host, started by `LLM`): one OS pipe to each other worker.
  Worker 0 writes and goes on at once (the pipe buffers; a message larger than the buffer is written while
  the reader reads it); a worker waiting for its next call sleeps in `recv`, woken by the write. Worker 0
  does not wait out a broadcast before running its own share of every call, as it does with gloo's
  `broadcast_object_list`, and a decode step's call reaches the readers several times sooner
  (docs/benchmarks.md, "Decode").
- `GlooControl` (workers on several hosts, or under torchrun): `broadcast_object_list` on a gloo group.
A worker whose peer is gone gets an error, never a hang: the pipe's reader sees EOF when worker 0's process
is gone (no other process keeps its write end), worker 0's write fails once a reader's process is gone.
"""
import fcntl
import io
import pickle

import torch
import torch.distributed as dist

PIPE_BYTES = 1 << 20
NARROW_FROM = 1 << 16      # int64 tensors of at least this many values travel as int32 when their values fit:
                           # a 128K-token prompt's ids then fit the pipe's buffer (512 KB), and worker 0 does
                           # not wait for each other worker in turn to take them


class GlooControl:
    def __init__(self, group):
        self.group = group

    def send(self, message) -> None:
        dist.broadcast_object_list([message], src=0, group=self.group)

    def receive(self):
        message = [None]
        dist.broadcast_object_list(message, src=0, group=self.group)
        return message[0]


class PipeControl:
    """Worker 0 holds the write ends (`writers`, one per other worker); worker r holds its read end."""

    def __init__(self, writers=None, reader=None):
        self.writers, self.reader = writers or [], reader

    def send(self, message) -> None:
        data = dumps(message)
        for w in self.writers:
            w.send_bytes(data)

    def receive(self):
        return pickle.loads(self.reader.recv_bytes())


def make_pipes(ctx, world_size: int):
    """-> (worker 0's write ends, [None, read end of worker 1, ...]) for `PipeControl`. The caller closes its
    own copies once the workers have started (`close_parent_ends`), so that EOF and broken pipes reach them."""
    pairs = [ctx.Pipe(duplex=False) for _ in range(world_size - 1)]      # (read end, write end)
    for _, w in pairs:
        _widen(w)
    return [w for _, w in pairs], [None] + [r for r, _ in pairs]


def _widen(conn) -> None:
    """The pipe's buffer to PIPE_BYTES (Linux; 64 KB by default), so that worker 0's write of a prompt of up
    to ~128K token ids returns at once instead of waiting for each reader in turn to take it."""
    try:
        fcntl.fcntl(conn.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (AttributeError, OSError):      # not Linux, or above /proc/sys/fs/pipe-max-size: the default stays
        pass


def close_parent_ends(writers, readers) -> None:
    for conn in list(writers) + [r for r in readers if r is not None]:
        conn.close()


def dumps(obj) -> bytes:
    """pickle, with CPU tensors as their raw bytes: torch's own reduction of a tensor costs ten times as much
    or more to write and read, for a decode step's ids as for a long prompt's. Large int64 tensors whose
    values fit go as int32 (NARROW_FROM) and come back int64."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {torch.Tensor: _reduce_tensor}
    pickler.dump(obj)
    return buffer.getvalue()


def _reduce_tensor(t: torch.Tensor):
    if t.device.type != "cpu" or t.layout != torch.strided or t.requires_grad or t.is_quantized or t.is_conj() \
            or t.is_neg():
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    sent = t
    if t.dtype == torch.int64 and t.numel() >= NARROW_FROM:     # a prompt's token ids: half the bytes
        low, high = torch.aminmax(t)
        if -(1 << 31) <= low and high < (1 << 31):
            sent = t.to(torch.int32)
    raw = sent.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return _tensor_from_bytes, (raw, sent.dtype, t.dtype, tuple(t.shape))


def _tensor_from_bytes(raw: bytes, sent: torch.dtype, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(sent).view(shape).to(dtype)
