"""The launcher's PMI server (``parallelkit.train.ranks.pmi``): MPICH's wire protocol spoken by hand
from both ends, then real MPI ranks forked by the launcher, on 2-4 ranks, with nothing
listening outside the machine."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from parallelkit.train.ranks.launch import mpich_available
from parallelkit.train.ranks.pmi import PmiServer

pytestmark = pytest.mark.timeout(300)


class Rank:
    """One rank's end of the pair, speaking the protocol line by line."""

    def __init__(self, server: PmiServer, rank: int) -> None:
        self.sock = socket.socket(fileno=os.dup(server.rank_fd(rank)))
        self.sock.settimeout(10)
        self.pending = b""

    def ask(self, line: str) -> dict[str, str]:
        self.sock.sendall(line.encode() + b"\n")
        return self.answer()

    def answer(self) -> dict[str, str]:
        while b"\n" not in self.pending:
            data = self.sock.recv(4096)
            assert data, "the server closed the pair"
            self.pending += data
        line, _, self.pending = self.pending.partition(b"\n")
        return dict(word.split("=", 1) for word in line.decode().split())


def test_the_protocol_as_mpich_speaks_it():
    server = PmiServer(2)
    a, b = Rank(server, 0), Rank(server, 1)
    thread = server.serve()
    init = a.ask("cmd=init pmi_version=1 pmi_subversion=1")
    assert init == {"cmd": "response_to_init", "pmi_version": "1", "pmi_subversion": "1",
                    "rc": "0"}  # fmt: skip
    assert a.ask("cmd=get_maxes")["vallen_max"] == "1024"
    kvs = a.ask("cmd=get_my_kvsname")["kvsname"]
    assert kvs == b.ask("cmd=get_my_kvsname")["kvsname"] != PmiServer(2).kvsname  # per job
    mapping = a.ask(f"cmd=get kvsname={kvs} key=PMI_process_mapping")
    assert (mapping["rc"], mapping["value"]) == ("0", "(vector,(0,1,2))")  # one node
    assert a.ask(f"cmd=put kvsname={kvs} key=card-0 value=addr0")["rc"] == "0"

    a.sock.sendall(b"cmd=barrier_in\n")
    a.sock.settimeout(0.5)
    with pytest.raises(TimeoutError):  # the barrier holds until every rank has entered
        a.answer()
    a.sock.settimeout(10)
    assert b.ask("cmd=barrier_in") == {"cmd": "barrier_out", "rc": "0"}
    assert a.answer() == {"cmd": "barrier_out", "rc": "0"}

    assert b.ask(f"cmd=get kvsname={kvs} key=card-0")["value"] == "addr0"
    assert b.ask(f"cmd=get kvsname={kvs} key=card-9")["rc"] == "-1"
    assert b.ask("cmd=spawn nprocs=2")["rc"] == "-1"  # answered, not left hanging
    assert a.ask("cmd=finalize") == {"cmd": "finalize_ack", "rc": "0"}
    a.sock.close()
    b.sock.close()
    thread.join(10)
    assert not thread.is_alive()  # it ends when every rank has closed its end


_RANKS = """
import sys
from parallelkit.train.ranks import launch

def entry(args):
    from mpi4py import MPI
    import numpy as np
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    total = world.allreduce(rank + 1)
    right = world.sendrecv(rank, dest=(rank + 1) % size, source=(rank - 1) % size)
    half = world.Split(rank % 2, rank)
    print(f"rank {rank}/{size} total={total} from={right} half={half.Get_size()}", flush=True)
    world.Barrier()
    if rank == 0:
        import subprocess
        ss = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
        print("LISTEN|" + ss.replace("\\n", "|"), flush=True)
    world.Barrier()
    return 0

sys.exit(launch.launch([*launch.PACKAGE_CLI, "x"], int(sys.argv[1]), "mpi", entry=entry))
"""


@pytest.mark.skipif(not mpich_available(), reason="needs mpi4py and MPICH (pip install mpich)")
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_forked_mpi_ranks_run_collectives_with_every_socket_on_loopback(ranks):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_RANKS), str(ranks)], env=env,
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(re.findall(r"rank \d+/\d+ total=\d+ from=\d+ half=\d+", proc.stdout))
    total = ranks * (ranks + 1) // 2
    assert lines == [f"rank {r}/{ranks} total={total} from={(r - 1) % ranks} "
                     f"half={(ranks - r % 2 + 1) // 2}" for r in range(ranks)]  # fmt: skip
    if shutil.which("ss"):  # the job's own listeners: pk-rank-N (forks), none of the launcher's
        (listen,) = [line for line in proc.stdout.splitlines() if line.startswith("LISTEN")]
        ours = [e for e in listen.split("|")[1:] if re.search(r'"pk-rank-\d+"', e)]
        addresses = [e.split()[3] for e in ours]
        assert all(a.startswith("127.0.0.1:") for a in addresses), addresses
