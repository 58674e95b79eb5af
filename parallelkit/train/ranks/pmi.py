"""The process manager's side of MPI's PMI-1 wire protocol, served by the launcher to the MPI
ranks it starts on this machine.

Why. ``mpiexec`` (MPICH's Hydra) opens its control port on every network interface whatever
its options (``-iface lo``, ``-localhost``: measured with ``ss -ltnp``), so local ranks started
through it would break the launcher's promise that nothing of a job listens outside the
machine, and gloo, which keeps that promise, takes about 1 ms for a small all-reduce here where
MPI takes 5-10 us. MPICH's own forking process manager (``mpiexec.gforker``) shows a third way:
each rank gets one end of a socket pair (``PMI_FD``) and speaks PMI-1 over it to the process
that started it, and nothing listens. The launcher does the same, so its MPI ranks can be
forks, as gloo's are; their messages go through shared memory (``PMI_process_mapping`` puts
them on one node), and the sockets MPICH's network modules open are kept on loopback
(:func:`~parallelkit.train.ranks.launch.mpi_loopback_env`).

The protocol (MPICH's ``simple`` PMI): lines of ``key=value`` words ending in a newline,
``cmd=`` first. A rank initializes, reads the limits, its application number and the name of
the key-value space, puts its business card and gets its peers' between barriers, and
finalizes. Spawning processes and publishing names are answered with an error: the ranks of
a training job do neither. ``abort`` is not answered: MPICH's MPI_Abort returns after sending
it, and a rank of parallelkit exits with its code next (:mod:`parallelkit.comm.mpi`), which
the launcher sees as any failed rank.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import selectors
import socket
import threading

_MAXES = "kvsname_max=256 keylen_max=64 vallen_max=1024"  # MPICH's own limits


class PmiServer:
    """PMI-1 for ``world`` local ranks: :meth:`rank_env` and :meth:`rank_fd` go to each rank
    (a fork keeps its descriptor, a new process gets it through ``pass_fds``), the rank calls
    :meth:`in_rank` first (a fork holds every rank's end), and the launcher calls
    :meth:`serve` once the ranks are started."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.kvsname = f"kvs_{os.getpid()}_{secrets.token_hex(4)}"  # unique to this job
        self._pairs = [socket.socketpair() for _ in range(world)]
        self._kvs = {"PMI_process_mapping": f"(vector,(0,1,{world}))"}  # node 0: all ranks
        self._barrier: list[socket.socket] = []

    def rank_env(self, rank: int) -> dict[str, str]:
        """MPICH's variables for ``rank``: its end of the pair, its rank and the world's."""
        return {
            "PMI_FD": str(self.rank_fd(rank)),
            "PMI_RANK": str(rank),
            "PMI_SIZE": str(self.world),
            "MPI_LOCALRANKID": str(rank),
            "MPI_LOCALNRANKS": str(self.world),
        }

    def rank_fd(self, rank: int) -> int:
        return self._pairs[rank][1].fileno()

    def in_rank(self, rank: int) -> None:
        """In a forked rank: close every descriptor of the pairs but its own end, so that a
        rank's end closes when that rank exits, whoever else was forked after it."""
        for r, (server, client) in enumerate(self._pairs):
            server.close()
            if r != rank:
                client.close()

    def serve(self) -> threading.Thread:
        """Answer the ranks from a thread until every rank has closed its end. Called after the
        ranks are started (a fork copies no thread): the launcher's copies of the ranks' ends
        are closed here."""
        for _, client in self._pairs:
            client.close()
        thread = threading.Thread(target=self._loop, name="parallelkit-pmi", daemon=True)
        thread.start()
        return thread

    def _loop(self) -> None:
        with selectors.DefaultSelector() as selector:
            for server, _ in self._pairs:
                selector.register(server, selectors.EVENT_READ, bytearray())
            while selector.get_map():
                for key, _ in selector.select():
                    sock, pending = key.fileobj, key.data
                    data = sock.recv(65536)
                    if not data:  # the rank exited
                        selector.unregister(sock)
                        sock.close()
                        continue
                    pending += data
                    while b"\n" in pending:
                        line, _, rest = bytes(pending).partition(b"\n")
                        pending[:] = rest
                        self._answer(sock, line.decode())

    def _answer(self, sock: socket.socket, line: str) -> None:
        words = dict(w.split("=", 1) for w in line.split() if "=" in w)
        cmd = words.get("cmd", "")
        if cmd == "barrier_in":
            self._barrier.append(sock)
            if len(self._barrier) == self.world:
                for s in self._barrier:
                    _send(s, "cmd=barrier_out rc=0")
                self._barrier.clear()
            return
        if cmd == "abort":
            # MPICH's MPI_Abort returns after this line, the process manager being expected
            # to end the job: parallelkit's ranks exit with the code then (comm/mpi.py), and
            # the launcher stops the others.
            return
        _send(sock, self._reply(cmd, words))

    def _reply(self, cmd: str, words: dict[str, str]) -> str:
        if cmd == "init":
            return "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0"
        if cmd == "get_maxes":
            return f"cmd=maxes rc=0 {_MAXES}"
        if cmd == "get_appnum":
            return "cmd=appnum rc=0 appnum=0"
        if cmd == "get_my_kvsname":
            return f"cmd=my_kvsname rc=0 kvsname={self.kvsname}"
        if cmd == "get_universe_size":
            return f"cmd=universe_size rc=0 size={self.world}"
        if cmd == "put":
            self._kvs[words.get("key", "")] = words.get("value", "")
            return "cmd=put_result rc=0"
        if cmd == "get":
            if words.get("key") in self._kvs:
                return f"cmd=get_result rc=0 value={self._kvs[words['key']]}"
            return "cmd=get_result rc=-1 msg=key_not_found"
        if cmd == "finalize":
            return "cmd=finalize_ack rc=0"
        return f"cmd={cmd}_result rc=-1 msg=not_served_by_parallelkit"


def _send(sock: socket.socket, line: str) -> None:
    with contextlib.suppress(OSError):  # the rank is gone; the launcher sees its exit
        sock.sendall(line.encode() + b"\n")
