"""ParameterServer: server ranks own shards of the parameters and run the optimizer; workers push and pull.

[Note: roles and shards]
Of a group of N ranks the last ``num_servers`` (S) are servers and the first
W = N - S are workers, so group rank w < W is worker w (rank 0, the one that
usually prints, is always a worker) and group rank W + s is server s. The
parameters are grouped by dtype in the order each dtype first appears; a
dtype's parameters, concatenated, form one flat vector padded to a multiple
of S (``buffers.FlatShard``), and server s owns ``shard_bounds(numel, s, S)`` of it,
the same length on every server, as ZeRO does. Each server keeps one
``Parameter`` per dtype holding its slice and builds the optimizer over those
slices only, so optimizer state lives on the servers and nowhere else; as in
ZeRO-1 this equals training the whole model for elementwise optimizers (SGD,
Adam, AdamW). The constructor copies group rank 0's parameters and buffers
to every rank (one broadcast per dtype), so every server starts from the
same model.

[Note: messages]
All traffic runs over a private communicator split off the group when the
ParameterServer is built (an ``MPI_Comm_split`` with one color), so it never
matches the caller's own point-to-point messages, whatever their tags. A
worker's request is a 4-integer header (tag ``_TAG_REQUEST``: kind, the
version its gradient was computed on, length of a reason text, whether it
wants the final parameters) followed, for a push, by one gradient slice per
dtype (``_TAG_GRAD``) and, for a failure, by the reason (``_TAG_REASON``). A
server answers pulls with a header (``_TAG_REPLY``: OK or ABORT, its version,
reason length) and, if OK, its slice of each dtype (``_TAG_PARAMS``). The
library's ``recv``/``irecv`` take a concrete source (no ANY_SOURCE), so a
server keeps one ``irecv`` of a header posted per open worker and polls them with
``is_completed()`` (sleeping 10 us .. 1 ms between idle sweeps), handling
every completed one in worker order; a push's payload is received right
after its header. Replies go out with ``isend`` from copies, so a server
never waits for a worker and the optimizer may update the slice meanwhile.

[Note: sync and async]
``mode="sync"``: a server collects one gradient from every open worker,
sums them in worker order, divides by their number, applies one optimizer
step, and only then answers pulls of workers that pushed in that round. The
sum order is the order DDP's in-process all-reduce uses, so sync training
equals DDP on the same shards. ``mode="async"``: a server applies each
gradient, divided by W, as soon as the staleness bound allows
(``StalenessBound``, see staleness.py for the definition and the rule);
pulls that would break the bound wait. An async worker pulls from the
servers one at a time in server order (sync workers ask all at once): a
worker holding a fresh slice of server s while it waits for server s + 1
could otherwise block a gradient on s + 1 that another worker, holding
s + 1 and waiting on s, must send first. With the fixed order, the
gradients a server waits for belong to workers that are computing (they
hold every server's reply) or waiting on a later server, and what the last
server waits for belongs only to computing workers, so no cycle can form
(the lock-ordering argument).

[Note: shutdown and failure]
Every worker ends its conversation with each server with exactly one DONE
or FAILED request; a server's ``serve()`` returns once every worker has
sent one. DONE may ask for the final parameters, sent when all workers are
done (then the servers also swap slices, so every rank's model ends with the
final values). A worker that raises inside ``with ps:`` (or calls
``abort``) sends FAILED with the exception's text. A server that gets
FAILED stops applying updates and answers every pull with ABORT; a worker
that gets ABORT sends FAILED to every server (which spreads the news to any
server that had not heard) and raises ``PeerFailedError``; once every worker
has sent DONE or FAILED, the server raises ``PeerFailedError`` too. A
server's own exception is handled the same way (it aborts the run, drains,
then re-raises). No rank is left waiting; a rank that dies without a word
(a killed process) is caught only by ``ax.settings.timeout``, as for any
collective.
"""
# Modules: ``wrapper`` (ParameterServer, which runs one role and delegates to it),
# ``worker`` (Worker: pull, push, finish), ``server`` (ServerLoop), ``slices``
# (the flat vectors both sides hold), ``protocol`` (tags, kinds, header),
# ``staleness`` (the async bound).
from ...errors import ParameterServerError, PeerFailedError
from .protocol import MODES
from .staleness import StalenessBound
from .wrapper import ParameterServer

__all__ = ["ParameterServer", "ParameterServerError", "PeerFailedError", "MODES", "StalenessBound"]
