"""srun one task per device, simulated: four processes with SLURM's variables on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lockstep.launcher.spawn import find_free_port

_WORKER = """
import json, torch, torch.distributed as dist, lockstep
info = lockstep.init_distributed()
t = torch.tensor([float(info.rank)])
dist.all_reduce(t)
print(json.dumps({"rank": info.rank, "local_rank": info.local_rank, "world": info.world_size,
                  "local_world": info.local_world_size, "source": info.source,
                  "sum": t.item()}))
lockstep.shutdown_distributed()
"""


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_srun_two_nodes_of_two_without_ntasks_per_node():
    """`srun -n 4` over two nodes: ranks, local ranks and local world sizes as SLURM means them."""
    port = find_free_port()
    procs = []
    for rank in range(4):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "RANK", "LOCAL_", "WORLD_", "MASTER_"))}
        env.update(SLURM_PROCID=str(rank), SLURM_NTASKS="4", SLURM_LOCALID=str(rank % 2),
                   SLURM_NODEID=str(rank // 2), SLURM_TASKS_PER_NODE="2(x2)",
                   SLURM_JOB_NODELIST="127.0.0.1", SLURM_NODELIST="127.0.0.1",
                   SLURM_JOB_ID="77", MASTER_PORT=str(port), LOCKSTEP_DEVICE="cpu",
                   GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", _WORKER], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=100)
        assert proc.returncode == 0, err
        outputs.append(json.loads(out.strip().splitlines()[-1]))
    assert [o["rank"] for o in outputs] == [0, 1, 2, 3]
    assert [o["local_rank"] for o in outputs] == [0, 1, 0, 1]
    assert [o["local_world"] for o in outputs] == [2, 2, 2, 2]
    assert {o["source"] for o in outputs} == {"slurm"} and {o["world"] for o in outputs} == {4}
    assert {o["sum"] for o in outputs} == {6.0}


_ALONE = """
import datetime, lockstep
lockstep.init_distributed(timeout=datetime.timedelta(seconds=3))
"""


@pytest.mark.timeout(60)
def test_one_process_where_slurm_counts_several_tasks_is_told_to_use_srun():
    """`python train.py` run directly in an sbatch script with --ntasks=4: SLURM_PROCID=0 and
    SLURM_NTASKS=4, one process. It cannot meet the others; the error says why, after torch's."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RANK", "LOCAL_", "WORLD_", "MASTER_"))}
    env.update(SLURM_PROCID="0", SLURM_NTASKS="4", SLURM_LOCALID="0", SLURM_NODEID="0",
               SLURM_TASKS_PER_NODE="4", SLURM_NODELIST="127.0.0.1", SLURM_JOB_ID="77",
               MASTER_PORT=str(find_free_port()), LOCKSTEP_DEVICE="cpu", GLOO_SOCKET_IFNAME="lo")
    done = subprocess.run([sys.executable, "-c", _ALONE], check=False, env=env, capture_output=True, text=True,
                          timeout=50)
    assert done.returncode != 0
    assert "clients joined" in done.stderr or "Timed out" in done.stderr  # torch's message stays
    assert "SLURM says this job step has 4 tasks (SLURM_NTASKS) and this process is task 0" in done.stderr
    assert "start it with `srun python train.py`" in done.stderr
