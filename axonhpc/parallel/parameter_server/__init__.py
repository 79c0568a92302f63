"""ParameterServer: server ranks own shards of the parameters and run the optimizer; workers push and pull.

[Note: roles and shards]
The last S ranks are servers and the first W are workers, so group rank 0 (the one that usually prints) is
always a worker. A dtype's parameters form one flat vector padded to a multiple of S, and server s owns an
equal slice of it and the optimizer over that slice, so optimizer state lives on the servers only; as in
ZeRO-1 this equals whole-model training for elementwise optimizers (SGD, Adam, AdamW).

[Note: messages]
All traffic runs over a private communicator split off the group, so it never matches the caller's own
point-to-point messages, whatever their tags. The library's ``recv``/``irecv`` take a concrete source (no
ANY_SOURCE), so a server keeps one header ``irecv`` posted per open worker and polls them (sleeping 10 us ..
1 ms between idle sweeps), handling completed ones in worker order. Replies go out with ``isend`` from
copies, so a server never waits for a worker and the optimizer may update the slice meanwhile.

[Note: sync and async]
Sync: a server sums one gradient from every open worker in worker order (the order DDP's in-process
all-reduce uses, so sync training equals DDP), applies one step, then answers the pulls of that round. Async:
each gradient is applied as soon as the staleness bound allows (staleness.py). An async worker pulls from
the servers one at a time in server order: a worker holding server s's fresh slice while waiting for s + 1
could otherwise block a gradient that another worker, holding s + 1 and waiting on s, must send first. With
the fixed order no cycle can form (the lock-ordering argument).

[Note: shutdown and failure]
Every worker ends with each server with exactly one DONE or FAILED request (none after that server's last word,
below), and ``serve()`` returns once every worker has sent one; each DONE is answered. A server that gets FAILED
answers every pull and DONE with ABORT; a worker that gets ABORT
sends FAILED to every server (spreading the news to servers that had not heard) and raises
``PeerFailedError``, as the servers do once drained. Once drained, the servers send one another OK or ABORT
before they answer the final pulls and swap slices: a server whose optimizer failed on the last update (after
every worker's DONE, so no worker spreads the news) makes the others answer ABORT and raise
``PeerFailedError`` naming it instead of waiting for its slices. A server that fails, once or again while it
answers ABORT, never leaves before the workers have stopped; each failure goes into its ABORT replies and its
verdict ([Note: a server's own failures] in ``server``). A server that stops listening to a worker still open (it
gave the worker up after the time limit, or leaves early: a ``KeyboardInterrupt``, messages that stopped coming
through) sends it its last word first, an ABORT marked CLOSED that the worker takes as its next answer however late
it comes ([Note: a server's last word] in ``server``); an interrupted server re-raises the interrupt. No rank is
left waiting; a rank that goes silent is caught only by ``ax.settings.timeout``, as for any collective, and a dead
one under ULFM by the revoked communicator.
"""
# Modules: ``wrapper`` (ParameterServer, which runs one role and delegates to it),
# ``worker`` (Worker: pull, push, finish), ``server`` (ServerLoop), ``slices``
# (the flat vectors both sides hold), ``protocol`` (tags, kinds, header),
# ``staleness`` (the async bound), ``interrupts`` (a Ctrl-C held until the
# server's messages are whole).
from ...errors import ParameterServerError, PeerFailedError
from .protocol import MODES
from .staleness import StalenessBound
from .wrapper import ParameterServer

__all__ = ["ParameterServer", "ParameterServerError", "PeerFailedError", "MODES", "StalenessBound"]
