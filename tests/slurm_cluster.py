"""A real single-node Slurm on loopback for the tests (../shared/notes/slurm-local.md).

``LocalSlurm().start()`` starts munged, slurmctld and slurmd as this (root) user with every
file they write — munge key and socket, slurm.conf, state, spool, pid and log files — in a new
folder under /tmp (munged wants every folder above its socket world-executable, which pytest's
tmp_path is not); ``stop()`` ends them by the PIDs in their pid files and removes the folder. The node advertises this machine's
CPUs (2 in CI), no GRES. ``env`` is the environment for sbatch/scontrol (``SLURM_CONF``);
``job(id)`` reads ``scontrol show job`` (accounting is off: no sacct).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol")

SLURM_CONF = """\
ClusterName=fbt-test
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
AuthInfo=socket={base}/munge/munge.socket,cred_expire=10
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SchedulerParameters=bf_interval=1,sched_interval=1
KillWait=30
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd.pid
SlurmctldLogFile={base}/slurmctld.log
SlurmdLogFile={base}/slurmd.log
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=20000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


def missing_binaries() -> list:
    return [name for name in DAEMONS if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]


class LocalSlurm:
    def __init__(self):
        self.base = Path(tempfile.mkdtemp(prefix="fbt-slurm-"))
        self.base.chmod(0o755)
        self.conf = self.base / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._hurried = set()  # (job, restart) whose start was brought forward

    def _run(self, *cmd, check=True) -> str:
        run = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if check and run.returncode:
            raise RuntimeError(f"{' '.join(cmd)}: {run.stdout}{run.stderr}")
        return run.stdout

    def start(self) -> "LocalSlurm":
        munge = self.base / "munge"
        for folder in (munge, self.base / "state", self.base / "spool"):
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o755)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.conf.write_text(SLURM_CONF.format(base=self.base, cpus=os.cpu_count()))
        self._run(_sbin("munged"), f"--key-file={key}", f"--socket={munge}/munge.socket", f"--pid-file={munge}/munged.pid",
                  f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed")
        self._run(_sbin("slurmctld"), "-f", str(self.conf))
        self._run(_sbin("slurmd"), "-f", str(self.conf), "-N", "localhost")
        deadline = time.time() + 30
        while "idle" not in self._run("sinfo", "-h", "-o", "%T", check=False):
            if time.time() > deadline:
                raise RuntimeError("the loopback Slurm did not come up:\n" + (self.base / "slurmctld.log").read_text()[-2000:])
            time.sleep(0.2)
        return self

    def stop(self, keep_logs: Optional[Path] = None) -> None:
        """Cancel the jobs left (their slurmstepd processes outlive slurmd), end the daemons and
        remove the folder, the daemons' logs copied to ``keep_logs`` first."""
        jobs = self._run("squeue", "-h", "-o", "%i", check=False).split()
        if jobs:
            self._run("scancel", *jobs, check=False)
            deadline = time.time() + 60
            while self._run("squeue", "-h", "-o", "%i", check=False).split() and time.time() < deadline:
                time.sleep(0.5)
        for pid_file in (self.base / "slurmd.pid", self.base / "slurmctld.pid", self.base / "munge" / "munged.pid"):
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass
        time.sleep(0.5)
        for log in (self.base / "slurmctld.log", self.base / "slurmd.log") if keep_logs else ():
            if log.exists():
                shutil.copy(log, keep_logs / log.name)
        shutil.rmtree(self.base, ignore_errors=True)

    def job(self, job_id: int) -> dict:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...)."""
        fields = {}
        for word in self._run("scontrol", "show", "job", "-o", str(job_id)).split():
            key, _, value = word.partition("=")
            fields[key] = value
        return fields

    def wait_for(self, job_id: int, states, restarts: int = 0, timeout: float = 300) -> dict:
        """Wait until the job's ``restarts``-th run is in one of ``states`` (a job ending in another
        state is an error). A requeued job starts 2 s after it is pending (``StartTime=now+2``)
        instead of after its eligibility time (requeue + cred_expire); not sooner: slurmd refuses
        a job credential created in the second its previous run's was revoked."""
        deadline = time.time() + timeout
        while True:
            info = self.job(job_id)
            state, restarted = info["JobState"], int(info.get("Restarts", 0))
            if state in states and restarted == restarts:
                return info
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                raise AssertionError(f"job {job_id} ended {state} (restart {restarted}) waiting for {states} at restart {restarts}")
            if state == "PENDING" and restarted > 0 and (job_id, restarted) not in self._hurried:
                self._hurried.add((job_id, restarted))  # once: each update moves the start again
                self._run("scontrol", "update", f"JobId={job_id}", "StartTime=now+2", check=False)
            if time.time() > deadline:
                raise TimeoutError(f"job {job_id} still {state} (restart {restarted}) after {timeout} s")
            time.sleep(0.3)

    def requeue(self, job_id: int) -> None:
        self._run("scontrol", "requeue", str(job_id))

    def signal_batch(self, job_id: int, name: str) -> None:
        """Signal the batch shell as ``--signal=B:<name>@S`` does S seconds before the time limit."""
        self._run("scancel", "--batch", f"--signal={name}", str(job_id))


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))
