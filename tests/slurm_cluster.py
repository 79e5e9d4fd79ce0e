"""A real Slurm of several nodes on this one machine, for the tests (../shared/notes/slurm-local.md,
../shared/notes/slurm-multinode.md).

``SlurmCluster(nodes=3).start()`` gives every node a network namespace of its own (``fbt-<tag>-n1``
…) with its own address (10.77.X.1 …) on a bridge (``fbtb<tag>``), where slurmctld listens
(10.77.X.254, on a free port), and starts
munged and slurmctld here and one ``slurmd -N nX`` inside each namespace, under the host name nX:
jobs, their srun steps, torchrun's rendezvous and gloo's connections go from node to node over the
bridge as on a cluster. The nodes resolve the node names (``/etc/netns/<namespace>/hosts``, mounted over
/etc/hosts for the node's slurmd and what it starts). Every other file the daemons write — munge key and
socket, slurm.conf, state, spools, pid and log files — lies in a new folder under /tmp (munged
wants every folder above its socket world-executable, which pytest's tmp_path is not). ``stop()``
ends every process of the namespaces and the daemons, removes the namespaces, the bridge and the
folder. Several clusters run side by side on one host (two test suites, a sandbox beside CI): each
has its own tag (from its folder's name), subnet (the first 10.77.X/24 no interface holds, chosen
under a host-wide lock) and slurmctld port; a cluster left by a killed test run is cleaned up by the
next one to start only once the process that made it (``<folder>/owner``) is gone, by its folder's
name and its own network's names, never by a pattern another live cluster matches. Each node advertises this machine's CPUs (2 in CI), no GRES; the partition ``debug`` holds
them all.

``env`` is the environment for sbatch/scontrol (``SLURM_CONF``); ``job(id)`` reads ``scontrol show
job`` (accounting is off: no sacct). ``kill_node(name)`` kills a node as a power loss would (its
slurmd and every process of its namespace, SIGKILL: Slurm marks it down after ``SlurmdTimeout``,
10 s here); ``start_node(name)`` brings it back.

``SlurmCluster(pyxis=True)`` also loads pyxis (``find_pyxis()``; ../shared/notes/pyxis-enroot.md) from a
plugstack.conf in the folder, so that ``srun --container-image=/abs/image.sqsh`` runs a step in an
enroot container on the nodes. Each node has a disk of its own, ``<folder>/nodes/nX``, mounted at
``<folder>/local`` for its slurmd (enroot's names — ``pyxis_<job>_<job>.<step>`` — are the same on
every node of a step): pyxis keeps its runtime files in ``local/pyxis``, enroot its containers in
``local/enroot-data`` (``XDG_DATA_HOME``/``XDG_RUNTIME_DIR`` in ``env``, which jobs submitted with it pass
on to pyxis; pyxis drops ``ENROOT_*_PATH`` from a job's environment); named containers are per job
(``container_scope=job``). pyxis unpacks the image on every node of every step (4–15 s for 130 MB
here; a named container once per job).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "ip", "nsenter", "unshare")
CONTROLLER = 254  # slurmctld's address on the bridge: <network>.254; the nodes <network>.1, <network>.2, ...
LOCK = Path(tempfile.gettempdir()) / "fbt-slurm.lock"  # held while a cluster picks its subnet and builds its network

SLURM_CONF = """\
ClusterName=fbt-test
SlurmctldHost={host}({network}.{controller})
SlurmUser=root
SlurmdUser=root
SlurmctldPort={port}
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
SlurmdTimeout=10
# A slurmd of this loaded 2-core host once took over 10 s (the default) to answer the terminate of a failed
# attempt's step; slurmctld retries such an RPC 60 s later (its agent_retry), when the requeued attempt's
# training step had the same ID (<job>.1) and was cancelled by it. A dead node refuses at once: its tests
# wait no longer.
MessageTimeout=30
SchedulerParameters=bf_interval=1,sched_interval=1
KillWait=30
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool/%n
SlurmctldPidFile={base}/slurmctld.pid
SlurmdPidFile={base}/slurmd-%n.pid
SlurmctldLogFile={base}/slurmctld.log
SlurmdLogFile={base}/slurmd-%n.log
{plugstack}{nodes}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""
NODE = "NodeName={name} NodeHostname={name} NodeAddr={address} CPUs={cpus} RealMemory=7000 State=UNKNOWN"


PYXIS_FOLDERS = ("/usr/local/lib/slurm", "/usr/lib/x86_64-linux-gnu/slurm-wlm", "/usr/lib/slurm", "/usr/lib64/slurm")


def find_pyxis() -> Optional[Path]:
    """pyxis' SPANK plugin: ``$FBT_PYXIS``, else spank_pyxis.so in a usual plugin folder; None where it
    or enroot is missing."""
    places = [os.environ["FBT_PYXIS"]] if os.environ.get("FBT_PYXIS") else [f"{d}/spank_pyxis.so" for d in PYXIS_FOLDERS]
    plugin = next((Path(p) for p in places if Path(p).is_file()), None)
    return plugin if plugin and shutil.which("enroot") else None


def missing_binaries() -> list:
    return [name for name in DAEMONS if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]


class SlurmCluster:
    def __init__(self, nodes: int = 3, pyxis: bool = False):
        self.pyxis = find_pyxis() if pyxis else None
        if pyxis and self.pyxis is None:
            raise RuntimeError("pyxis asked for, but spank_pyxis.so or enroot is missing (../shared/notes/pyxis-enroot.md)")
        self.base = Path(tempfile.mkdtemp(prefix="fbt-slurm-"))
        self.base.chmod(0o755)
        self.conf = self.base / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        if self.pyxis:
            self.env.update(XDG_DATA_HOME=str(self.base / "local" / "enroot-data"), XDG_RUNTIME_DIR=str(self.base / "local" / "enroot-run"))
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.tag = re.sub(r"[^a-z0-9]", "0", self.base.name[-6:].lower())  # its network's names: fbtb<tag>, fbt-<tag>-nX
        self.bridge, self.network, self.port = f"fbtb{self.tag}", None, None  # subnet and slurmctld port: at start
        (self.base / "owner").write_text(str(os.getpid()))
        self._hurried = set()  # (job, restart) whose start was brought forward

    def address(self, node: str) -> str:
        return f"{self.network}.{self.nodes.index(node) + 1}"

    def namespace(self, node: str) -> str:
        return f"fbt-{self.tag}-{node}"

    def veth(self, node: str) -> str:
        return f"fbtv{self.tag}{node}"

    def _run(self, *cmd, check=True) -> str:
        run = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if check and run.returncode:
            raise RuntimeError(f"{' '.join(cmd)}: {run.stdout}{run.stderr}")
        return run.stdout

    def start(self) -> "SlurmCluster":
        _end_leftovers()  # a test run killed before its teardown left its daemons, jobs and network
        munge = self.base / "munge"
        nodes_disks = (self.base / "local", *(self.base / "nodes" / n for n in self.nodes)) if self.pyxis else ()
        for folder in (munge, self.base / "state", *(self.base / "spool" / n for n in self.nodes), *nodes_disks):
            folder.mkdir(parents=True, exist_ok=True)
            folder.chmod(0o755)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        with open(LOCK, "w") as lock:  # two clusters starting at once pick different subnets
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.network, self.port = _free_subnet(), _free_port()
            (self.base / "network.json").write_text(json.dumps({"bridge": self.bridge, "namespaces": [self.namespace(n) for n in self.nodes],
                                                                "veths": [self.veth(n) for n in self.nodes]}))
            self._network()
        plugstack = ""
        if self.pyxis:
            (self.base / "plugstack.conf").write_text(f"required {self.pyxis} runtime_path={self.base}/local/pyxis container_scope=job\n")
            plugstack = f"PlugStackConfig={self.base}/plugstack.conf\n"
        nodes = "\n".join(NODE.format(name=n, address=self.address(n), cpus=os.cpu_count())
                          for n in self.nodes)
        self.conf.write_text(SLURM_CONF.format(base=self.base, host=os.uname().nodename, network=self.network, controller=CONTROLLER,
                                               port=self.port, nodes=nodes,
                                               plugstack=plugstack, names=",".join(self.nodes)))
        self._run(_sbin("munged"), f"--key-file={key}", f"--socket={munge}/munge.socket", f"--pid-file={munge}/munged.pid",
                  f"--log-file={munge}/munged.log", f"--seed-file={munge}/munged.seed")
        self._run(_sbin("slurmctld"), "-f", str(self.conf))
        for node in self.nodes:
            self.start_node(node)
        self.wait_for_nodes("idle", self.nodes)
        return self

    def _network(self) -> None:
        """The bridge (slurmctld's address) and one namespace per node, wired to it by a veth pair."""
        ip = shutil.which("ip") or "/usr/sbin/ip"
        self._run(ip, "link", "add", self.bridge, "type", "bridge")
        self._run(ip, "addr", "add", f"{self.network}.{CONTROLLER}/24", "dev", self.bridge)
        self._run(ip, "link", "set", self.bridge, "up")
        names = "".join(f"{self.address(n)} {n}\n" for n in self.nodes)
        for node in self.nodes:
            ns, veth = self.namespace(node), self.veth(node)
            hosts = Path("/etc/netns", ns, "hosts")
            hosts.parent.mkdir(parents=True, exist_ok=True)
            hosts.write_text(f"127.0.0.1 localhost\n{names}")
            self._run(ip, "netns", "add", ns)
            self._run(ip, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._run(ip, "link", "set", veth, "master", self.bridge, "up")
            self._run(ip, "netns", "exec", ns, "ip", "addr", "add", f"{self.address(node)}/24", "dev", "eth0")
            self._run(ip, "netns", "exec", ns, "ip", "link", "set", "eth0", "up")
            self._run(ip, "netns", "exec", ns, "ip", "link", "set", "lo", "up")

    def start_node(self, node: str) -> None:
        """The node's slurmd, inside its network namespace, with its own host name (a UTS namespace)
        and a mount namespace where the node's hosts file lies over /etc/hosts (as ``ip netns exec``
        does, without remounting /sys, which would hide the cgroup file system slurmd reads) and, with
        pyxis, the node's own disk over ``<folder>/local``."""
        ns = self.namespace(node)
        local = f"mount --bind {self.base}/nodes/{node} {self.base}/local && " if self.pyxis else ""
        self._run("nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c",
                  f"hostname {node} && mount --bind /etc/netns/{ns}/hosts /etc/hosts && {local}"
                  f"exec {_sbin('slurmd')} -f {self.conf} -N {node}")

    def kill_node(self, node: str) -> None:
        """The node gone as a power loss takes it: its slurmd and every process on it, SIGKILLed."""
        for _ in range(3):  # processes started while the first ones were killed
            for pid in self._run("ip", "netns", "pids", self.namespace(node), check=False).split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)

    def processes(self, node: str) -> list:
        """The PIDs of the processes running on the node."""
        return [int(p) for p in self._run("ip", "netns", "pids", self.namespace(node), check=False).split()]

    def wait_for_nodes(self, state: str, nodes, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while True:
            states = dict(line.split() for line in self._run("sinfo", "-h", "-N", "-o", "%N %T", check=False).splitlines())
            if all(states.get(n, "").startswith(state) for n in nodes):
                return
            if time.time() > deadline:
                raise RuntimeError(f"nodes {states} not {state} after {timeout} s:\n"
                                   + (self.base / "slurmctld.log").read_text()[-2000:])
            time.sleep(0.3)

    def stop(self, keep_logs: Optional[Path] = None) -> None:
        """Cancel the jobs left, end every process of the nodes and the daemons, remove the network
        and the folder, the daemons' logs copied to ``keep_logs`` first."""
        jobs = self._run("squeue", "-h", "-o", "%i", check=False).split()
        if jobs:
            self._run("scancel", *jobs, check=False)
            deadline = time.time() + 60
            while self._run("squeue", "-h", "-o", "%i", check=False).split() and time.time() < deadline:
                time.sleep(0.5)
        for node in self.nodes:
            self.kill_node(node)
        for pid_file in (self.base / "slurmctld.pid", self.base / "munge" / "munged.pid"):
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass
        time.sleep(0.5)
        for log in [*self.base.glob("slurm*.log")] if keep_logs else ():
            shutil.copy(log, keep_logs / log.name)
        _remove_network(self.base)
        shutil.rmtree(self.base, ignore_errors=True)

    def job(self, job_id: int) -> dict:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, NodeList, ExcNodeList, ...)."""
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
            if state == "PENDING" and restarted > 0 and (job_id, restarted) not in self._hurried and "held" not in info.get("Reason", ""):
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


def _end_leftovers() -> None:
    """The clusters a killed test run left (``/tmp/fbt-slurm-*`` whose ``owner`` process is gone):
    SIGKILL the processes whose command lines or working folders name that folder, remove its
    network and the folder. A live cluster's (its owner running) are left alone."""
    for base in Path(tempfile.gettempdir()).glob("fbt-slurm-*"):
        try:
            os.kill(int((base / "owner").read_text()), 0)
            continue  # its test run is alive
        except (OSError, ValueError):
            pass
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and str(base) in (proc / "cmdline").read_text(errors="replace") + os.readlink(proc / "cwd"):
                    os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
        _remove_network(base)
        shutil.rmtree(base, ignore_errors=True)


def _remove_network(base: Path) -> None:
    """The namespaces, veth pairs and bridge the cluster of folder ``base`` made (``network.json``)."""
    try:
        made = json.loads((base / "network.json").read_text())
    except (OSError, ValueError):
        return
    for ns in made["namespaces"]:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(Path("/etc/netns", ns), ignore_errors=True)
    for link in [*made["veths"], made["bridge"]]:  # a veth where it outlived its namespace
        subprocess.run(["ip", "link", "del", link], capture_output=True)


def _free_subnet() -> str:
    """The first 10.77.X (a /24) that no interface of this host has an address in."""
    used = set(re.findall(r"inet 10\.77\.(\d+)\.", subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True,
                                                                    text=True).stdout))
    return f"10.77.{next(x for x in range(256) if str(x) not in used)}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))
