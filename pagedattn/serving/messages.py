"""What an engine core and its clients say to each other: the sockets, the message structs, the step's arrays.

One wire for every place a core runs: `inproc://NAME` for a core on a thread of the API process (the
sockets share the client's ZMQ context), `ipc://PATH` for a core process on the same machine, `tcp://HOST:P`
for one on another node. A core binds two endpoints derived from its address (`core_endpoints`):

  input   PULL   every client PUSHes its commands here (add, abort, stop a completion, snapshot, shutdown)
  output  ROUTER every client connects a DEALER with its own identity and says Hello; the core answers
                 Ready, then sends that client its requests' outputs and the metrics snapshots

Messages are msgspec structs (msgpack, tagged unions `ClientMessage` / `CoreMessage`, fields as arrays,
not maps); SamplingParams travels as itself (msgspec re-runs its validation on decode). The client numbers
its requests (`wire_id`); the engine's request id in the core is (client identity, wire_id), so two
clients never collide. Per step, each client with news gets ONE StepOutputs: one entry per completion
that advanced, as flat arrays

    wire_ids     int64  [E]   the client's number for the request
    index        int32  [E]   which of its n completions
    num_tokens   int32  [E]   how many new tokens the entry has (0 for a bare finish)
    token_ids    int32  [T]   every entry's new tokens, back to back (T = sum of num_tokens)
    logprobs     float64[T]   their log-probabilities (0 where the request did not ask)
    cumulative   float64[E]   the completion's cumulative log-probability
    finish       int8   [E]   0 running, else FINISH_REASONS[code]

plus `finished` (requests with every completion done) and `errors` ((wire id, kind, message): a request
refused when added, "invalid"; failed alone in the engine, its row's token outside the vocabulary say,
"failed"; or failed by a raising step, "step"). Nothing is one object per token.
"""
import itertools
from array import array

import msgspec
import numpy as np
import zmq

from pagedattn.sampling_params import SamplingParams

FINISH_REASONS = (None, "stop", "length", "abort")
_FINISH_CODE = {r: i for i, r in enumerate(FINISH_REASONS)}
# ZMTP heartbeats (the ZMQ I/O thread sends them, whatever Python is doing): a peer silent this long
# (a dead host, a cut network) counts as disconnected. (inproc:// has no connection to lose: ignored there.)
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 1000, 10000


class Hello(msgspec.Struct, tag=True, array_like=True):
    """Client -> core, on the output socket: register `client` (its DEALER identity)."""
    client: bytes


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    client: bytes
    wire_id: int
    prompt_token_ids: list[int]
    params: SamplingParams


class AbortRequests(msgspec.Struct, tag=True, array_like=True):
    client: bytes
    wire_ids: list[int]


class StopCompletion(msgspec.Struct, tag=True, array_like=True):
    """Completion `index` of a request ended in the API process (a stop string): stop computing it."""
    client: bytes
    wire_id: int
    index: int


class TakeSnapshot(msgspec.Struct, tag=True, array_like=True):
    """Answer with a Stats carrying `token`, taken after every command sent before this one."""
    client: bytes
    token: int


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


class Ready(msgspec.Struct, tag=True, array_like=True):
    """Core -> client, the answer to Hello: what the API side needs to validate requests."""
    rank: int
    info: dict


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    rank: int
    wire_ids: bytes
    index: bytes
    num_tokens: bytes
    token_ids: bytes
    logprobs: bytes
    cumulative: bytes
    finish: bytes
    finished: list[int]
    errors: list[tuple[int, str, str]]


class Stats(msgspec.Struct, tag=True, array_like=True):
    rank: int
    token: int              # the TakeSnapshot it answers, 0 when sent unasked
    metrics: dict


class Dead(msgspec.Struct, tag=True, array_like=True):
    rank: int
    reason: str


ClientMessage = Hello | AddRequest | AbortRequests | StopCompletion | TakeSnapshot | Shutdown
CoreMessage = Ready | StepOutputs | Stats | Dead


def core_endpoints(address):
    """The (input, output) ZMQ endpoints of a core address: "tcp://host:P" -> ports P and P + 1,
    "ipc://path" -> "ipc://path-in" and "ipc://path-out", "inproc://name" likewise."""
    if address.startswith("tcp://"):
        head, _, port = address.rpartition(":")
        return f"{head}:{int(port)}", f"{head}:{int(port) + 1}"
    if address.startswith(("ipc://", "inproc://")):
        return address + "-in", address + "-out"
    raise ValueError(f"engine core address must be tcp://HOST:PORT, ipc://PATH or inproc://NAME, got {address!r}")


def configure(sock):
    """The options every socket of the wire gets: unbounded queues (the engine never blocks on a slow
    reader; the client merges what its readers have not taken), no linger on close, heartbeats."""
    for option, value in ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.LINGER, 0),
                          (zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS), (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)):
        sock.setsockopt(option, value)
    return sock


def encode_step(rank, entries, finished, errors):
    """A StepOutputs from entries [(wire id, index, token ids, logprobs or None, cumulative, finish)]."""
    if not entries:
        empty = b""
        return StepOutputs(rank, empty, empty, empty, empty, empty, empty, empty, finished, errors)
    wire_ids, index, toks, lps, cumulative, reasons = zip(*entries)        # one pass per column, in C
    # array.array packs a list of Python numbers in C, several times faster than np.array for a few
    # hundred (native byte order and sizes: what decode_step's np.frombuffer reads on the same machine
    # kind; 'q' int64, 'i' int32, 'd' float64)
    num_tokens = array("i", map(len, toks))
    tokens = array("i", itertools.chain.from_iterable(toks))
    if lps.count(None) != len(lps):
        logprobs = array("d", itertools.chain.from_iterable(
            x if x is not None else [0.0] * n for x, n in zip(lps, num_tokens))).tobytes()
    else:
        logprobs = bytes(8 * len(tokens))           # float64 zeros
    if None in cumulative:
        cumulative = [c or 0.0 for c in cumulative]
    return StepOutputs(rank, array("q", wire_ids).tobytes(), array("i", index).tobytes(), num_tokens.tobytes(),
                       tokens.tobytes(), logprobs, array("d", cumulative).tobytes(),
                       bytes(map(_FINISH_CODE.__getitem__, reasons)), finished, errors)


def decode_step(msg):
    """StepOutputs -> dict of numpy arrays (views of the message's buffers) and the two lists."""
    return dict(wire_ids=np.frombuffer(msg.wire_ids, np.int64), index=np.frombuffer(msg.index, np.int32),
                num_tokens=np.frombuffer(msg.num_tokens, np.int32), token_ids=np.frombuffer(msg.token_ids, np.int32),
                logprobs=np.frombuffer(msg.logprobs, np.float64), cumulative=np.frombuffer(msg.cumulative, np.float64),
                finish=np.frombuffer(msg.finish, np.int8), finished=msg.finished, errors=msg.errors)
