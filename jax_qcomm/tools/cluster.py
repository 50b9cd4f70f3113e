"""A simulated bandwidth-limited cluster on one Linux machine: one JAX process per network namespace.

Usage (as root, with iproute2's ``ip`` and ``tc``)::

    python -m jax_qcomm.tools.cluster --nodes 4 --rate 1gbit [--out F.json] -- train.py --steps 10
    python -m jax_qcomm.tools.cluster --nodes 4 --rate 1gbit -- -m benchmarks allreduce --sizes 1M
    python -m jax_qcomm.tools.cluster --cleanup            # remove leftovers of killed runs

What comes after ``--`` is given to this Python interpreter on every node (a script or ``-m
module``), or to the one ``--python EXE`` names (another venv's, e.g. a PyTorch peer's: it gets the
same environment, and need not import jax). The repository's benchmarks have their own route,
``python -m benchmarks cluster ... -- allreduce ...``, which checks the benchmark's options first
and sets its ``--link-gbps``.

What it builds (all names start with ``<prefix><pid>``, default prefix ``qcl``, so it never touches
anything it did not create and two runs never collide):

* a Linux bridge ``<tag>br`` with no address, IPv6 link-local included (``addrgenmode none``), like
  the host ends of the veths: the host neither routes to the nodes nor from them;
* per node i a network namespace ``<tag>n<i>`` and a veth pair: the host end ``<tag>v<i>`` enslaved to
  the bridge, the other end moved into the namespace and renamed ``eth0``, with address
  ``<subnet>.(i+1)`` (default subnet 10.77.0.0/24); the namespace has only ``lo`` and that link, and
  no default route, so the traffic stays between the namespaces;
* each link shaped with ``tc qdisc add ... root tbf rate R`` in both directions: on the namespace
  end (what node i sends) and on the host end (what node i receives), like a full-duplex NIC port
  of rate R on a switch.

Then it checks the links (unless ``--no-link-check``): TCP transfers on every link at once, node i
to node i+1 (through both shapers of every veth), each flow timed from first to last byte, and runs
the program in every namespace through :func:`jax_qcomm.tools.launch.launch`: ``jax.distributed``
with the coordinator on node 0's address and gloo bound to ``eth0`` of each namespace
(``QCOMM_GLOO_INTERFACE``). Each process enters its namespace by ``ip netns exec`` (which also
remounts ``/sys`` so that the namespace's interfaces are the ones seen). With ``--out F`` the
program is also given ``--out TMP`` and must write a JSON object there; rank 0's is copied to F with
``metadata.cluster`` added: nodes, rate, the tc commands, addresses, the link check.

Placement (``--pin``, default ``auto``): each node's processes are pinned to a CPU of their own
(``sched_setaffinity`` before entering the namespace; node i on the i-th CPU this process may use)
when there are at least as many CPUs as nodes, so a node's codec work cannot borrow the core of a
node that waits on the network. With more nodes than CPUs (the 4-node runs on 2 cores) they are left
unpinned (``--pin yes``: round-robin). ``metadata.cluster.placement`` says which: "one core per
node" or "nodes sharing cores".

Teardown always runs: try/finally, SIGINT/SIGTERM/SIGHUP handlers, processes still inside the
namespaces are killed first (``ip netns pids``). ``--cleanup`` removes leftovers of runs whose process
is gone (``--force``: also of live ones).

Exit status: the program's (0 on success); 2 for bad arguments; 69 when the machine cannot do it
(not root, no ``ip`` / ``tc``, no network namespaces), with the reason printed; 124 on ``--timeout``.

On a 2-core machine 1 Gbit/s links hold (iperf ~950 Mbit/s); 10 Gbit/s cannot be simulated (the
veth/bridge path is CPU-bound at ~3 Gbit/s), and the processes share the same cores.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

from jax_qcomm.tools import launch

#: Exit status when the machine cannot host the cluster (sysexits' EX_UNAVAILABLE).
EXIT_UNAVAILABLE = 69
EXIT_USAGE = 2
DEFAULT_PREFIX = "qcl"
DEFAULT_SUBNET = "10.77.0.0/24"
DEFAULT_PORT = 29471
DEFAULT_TIMEOUT = 3600.0
NS_INTERFACE = "eth0"
MAX_NODES = 64
PROG = "python -m jax_qcomm.tools.cluster"

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
               "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9}

# Run in each node process by the launcher (``python -c STUB ip tag cpus exe args...``): pins the
# process to its CPU (``cpus``: one comma-separated entry per rank, empty for no pinning; the
# affinity is inherited through exec), enters the rank's namespace with `ip netns exec` (which also
# remounts /sys) and execs ``exe args...`` (a Python interpreter). No imports beyond os/sys, so the
# extra interpreter costs a
# few milliseconds.
_NODE_STUB = ("import os, sys; ip, tag, cpus, exe = sys.argv[1:5]; "
              "rank = int(os.environ['QCOMM_PROCESS_ID']); "
              "cpus and os.sched_setaffinity(0, {int(cpus.split(',')[rank])}); "
              "os.execv(ip, [ip, 'netns', 'exec', tag + 'n' + str(rank), exe, *sys.argv[5:]])")
PIN_MODES = ("auto", "yes", "no")

# Link check: node 0 receives, node 1 sends N bytes; the receiver times first byte to last byte.
_SINK = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(60)
print("ready", flush=True)
c, _ = s.accept(); c.settimeout(60)
buf = bytearray(1 << 20); got = 0; t0 = None
while True:
  k = c.recv_into(buf)
  if not k: break
  if t0 is None: t0 = time.perf_counter()
  got += k
print(got, time.perf_counter() - t0, flush=True)
"""
_SOURCE = r"""
import socket, sys
n = int(sys.argv[3]); block = b"\x5a" * (1 << 20)
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
while n > 0:
  c.sendall(block[:min(n, len(block))]); n -= len(block)
c.shutdown(socket.SHUT_WR); c.close()
"""


class Unavailable(Exception):
  """The machine cannot host the simulated cluster (the message says why)."""


class _Stop(Exception):
  """Raised by the signal handlers so that teardown runs through ``finally``."""

  def __init__(self, signum: int):
    super().__init__(signum)
    self.signum = signum


# -- arguments ----------------------------------------------------------------------------------------

def parse_rate(text: str) -> int:
  """A tc rate (``1gbit``, ``100mbit``, ``500kbit``, ``125mbps`` = bytes) in bits per second."""
  m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]+)\s*", str(text))
  if not m or m.group(2).lower() not in _RATE_UNITS:
    raise argparse.ArgumentTypeError(
        f"rate must be a number and a tc unit ({', '.join(_RATE_UNITS)}), e.g. 1gbit or 100mbit; "
        f"got {text!r}")
  bits = int(float(m.group(1)) * _RATE_UNITS[m.group(2).lower()])
  if bits < 100_000:
    raise argparse.ArgumentTypeError(f"rate must be at least 100kbit, got {text!r}")
  return bits


def tc_rate(bits_per_s: int) -> str:
  """The rate as tc writes it (``1gbit``, ``100mbit``, or bits)."""
  for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
    if bits_per_s % scale == 0:
      return f"{bits_per_s // scale}{unit}"
  return f"{bits_per_s}bit"


def tbf_params(bits_per_s: int) -> dict[str, str]:
  """tbf's bucket and queue for a rate: burst = 4 ms of traffic (at least 32 KiB), latency 50 ms."""
  burst = max(32 * 1024, int(bits_per_s / 8 * 0.004))
  return {"rate": tc_rate(bits_per_s), "burst": str(burst), "latency": "50ms"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
  """Adds the cluster's options to its subcommand parser."""
  add_cluster_options(parser)
  parser.add_argument("--out", default=None,
                      help="pass the program --out TMP and copy rank 0's JSON there to this file, "
                           "with metadata.cluster added")
  parser.add_argument("--python", default=None, metavar="EXE",
                      help="the Python interpreter that runs the program on the nodes (default: "
                           "this one)")
  parser.add_argument("--cleanup", action="store_true",
                      help="only remove leftovers (namespaces, bridge, veths) of runs with --prefix "
                           "whose process is gone, then exit")
  parser.add_argument("--force", action="store_true",
                      help="with --cleanup: also remove those of runs that are still alive")
  parser.add_argument("program", nargs=argparse.REMAINDER,
                      help="after --: what this Python interpreter runs on every node, e.g. "
                           "train.py --steps 10 or -m benchmarks allreduce --sizes 1M")


def add_cluster_options(parser: argparse.ArgumentParser, nodes: int = 4) -> None:
  """The options that build the cluster."""
  parser.add_argument("--nodes", type=int, default=nodes,
                      help=f"namespaces, one process each (2..{MAX_NODES}; default: {nodes})")
  parser.add_argument("--rate", type=parse_rate, default=None,
                      help="link rate of every node in each direction, a tc rate: 1gbit, 100mbit")
  parser.add_argument("--local-devices", type=int, default=None,
                      help="host (CPU) devices per process (QCOMM_LOCAL_DEVICES; default: 1)")
  parser.add_argument("--pin", choices=PIN_MODES, default="auto",
                      help="pin node i's processes to CPU i: 'yes' (round-robin when there are "
                           "more nodes than CPUs), 'no', or 'auto' (default: pin when every node "
                           "gets a CPU of its own). Recorded as metadata.cluster.placement")
  parser.add_argument("--prefix", default=DEFAULT_PREFIX,
                      help=f"name prefix, 1-4 lowercase letters (default: {DEFAULT_PREFIX}); names are "
                           "<prefix><pid>br / <prefix><pid>v<i> / <prefix><pid>n<i>")
  parser.add_argument("--subnet", default=DEFAULT_SUBNET,
                      help=f"private IPv4 subnet of the nodes (default: {DEFAULT_SUBNET})")
  parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                      help=f"coordinator port on node 0 (default: {DEFAULT_PORT})")
  parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                      help=f"kill each program run on the nodes after this many seconds "
                           f"(default: {DEFAULT_TIMEOUT:g})")
  parser.add_argument("--no-link-check", action="store_true",
                      help="skip the TCP transfers that measure the shaped links before the program")
  parser.add_argument("--malloc", choices=launch.MALLOC_MODES, default="reuse",
                      help="the launcher's malloc mode for the node processes (default: reuse; "
                           "glibc: no MALLOC_* variables, as under a launcher of the user's own)")
  parser.add_argument("--elastic", action="store_true",
                      help="an elastic run: a node process that dies is restarted with its rank "
                           "(launch --elastic; the coordination service is a process of its own "
                           "in node 0's namespace in every run)")
  parser.add_argument("--max-restarts", type=int, default=None,
                      help="--elastic: restarts per node process (default: the launcher's)")


def _check_prefix(prefix: str) -> str:
  if not re.fullmatch(r"[a-z]{1,4}", prefix or ""):
    raise ValueError(f"--prefix must be 1-4 lowercase letters (interface names have at most 15 "
                     f"characters), got {prefix!r}")
  return prefix


def validate_cluster(args: argparse.Namespace) -> None:
  """Checks the options of :func:`add_cluster_options` (ValueError naming the option)."""
  _check_prefix(args.prefix)
  if not (2 <= args.nodes <= MAX_NODES):
    raise ValueError(f"--nodes must be in 2..{MAX_NODES}, got {args.nodes}")
  if args.rate is None:
    raise ValueError("--rate is required, e.g. --rate 1gbit")
  if args.local_devices is not None and args.local_devices < 1:
    raise ValueError(f"--local-devices must be >= 1, got {args.local_devices}")
  if not (1024 <= args.port <= 65535):
    raise ValueError(f"--port must be in 1024..65535, got {args.port}")
  if not args.timeout > 0:
    raise ValueError(f"--timeout must be > 0, got {args.timeout}")
  try:
    net = ipaddress.IPv4Network(args.subnet, strict=True)
  except ValueError as e:
    raise ValueError(f"--subnet must be an IPv4 network such as {DEFAULT_SUBNET}: {e}") from None
  if not net.is_private:
    raise ValueError(f"--subnet must be a private network (10/8, 172.16/12, 192.168/16), got {net}")
  if net.num_addresses - 2 < args.nodes:
    raise ValueError(f"--subnet {net} has room for {max(0, net.num_addresses - 2)} nodes, "
                     f"not {args.nodes}")


def validate(args: argparse.Namespace) -> list[str]:
  """Checks the cluster options; returns the program's argv (what follows ``--``; [] with
  ``--cleanup``). Raises ValueError with a message naming the option."""
  _check_prefix(args.prefix)
  if args.cleanup:
    return []
  if args.force:
    raise ValueError("--force only goes with --cleanup")
  validate_cluster(args)
  exe = getattr(args, "python", None)
  if exe is not None and not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
    raise ValueError(f"--python must be an executable file, got {exe!r}")
  program = list(args.program)
  if program and program[0] == "--":
    program = program[1:]
  if not program:
    raise ValueError("give the program to run after --, e.g. -- train.py or -- -m module args")
  return program


def node_cpus(nodes: int, pin: str, available: Sequence[int] | None = None
              ) -> tuple[list[int] | None, str]:
  """The CPU of each node (None: unpinned) and the placement label recorded in the metadata.

  ``available``: the CPUs this process may use (default: its affinity). ``pin="auto"`` pins only
  when every node gets a CPU of its own; ``"yes"`` always (round-robin, nodes then share CPUs);
  ``"no"`` never. The label says whether the nodes share cores, since on a machine with fewer
  cores than nodes a node waiting on the network lends its core to the others' compute.
  """
  if pin not in PIN_MODES:
    raise ValueError(f"--pin must be one of {PIN_MODES}, got {pin!r}")
  cpus = sorted(os.sched_getaffinity(0) if available is None else available)
  if not cpus:
    raise ValueError("no CPU available")
  if pin == "no" or (pin == "auto" and nodes > len(cpus)):
    return None, f"nodes sharing cores: {nodes} unpinned nodes on {len(cpus)} CPUs"
  chosen = [cpus[i % len(cpus)] for i in range(nodes)]
  if nodes > len(cpus):
    return chosen, (f"nodes sharing cores: {nodes} nodes pinned round-robin to {len(cpus)} CPUs "
                    f"{chosen}")
  return chosen, f"one core per node (node i pinned to CPU {chosen}[i])"


# -- the machine --------------------------------------------------------------------------------------

def preflight(euid: int | None = None, which=shutil.which) -> tuple[str, str]:
  """(path of ``ip``, path of ``tc``); raises :class:`Unavailable` saying what is missing."""
  euid = os.geteuid() if euid is None else euid
  problems = []
  if euid != 0:
    problems.append(f"needs root (network namespaces, veths, a bridge, tc qdiscs); running as uid "
                    f"{euid}: run it with sudo")
  ip, tc = which("ip"), which("tc")
  if ip is None:
    problems.append("`ip` (iproute2) not found on PATH")
  if tc is None:
    problems.append("`tc` (iproute2) not found on PATH")
  if not os.path.exists("/proc/self/ns/net"):
    problems.append("this kernel has no network namespaces (/proc/self/ns/net missing)")
  if problems:
    raise Unavailable("; ".join(problems))
  return ip, tc


class Cluster:
  """The namespaces, veths, bridge and qdiscs of one run; :meth:`teardown` removes what was made."""

  def __init__(self, nodes: int, rate_bits: int, *, ip: str, tc: str, prefix: str = DEFAULT_PREFIX,
               subnet: str = DEFAULT_SUBNET, log=None):
    self.nodes = nodes
    self.rate_bits = rate_bits
    self.ip, self.tc = ip, tc
    self.tag = f"{_check_prefix(prefix)}{os.getpid()}"
    net = ipaddress.IPv4Network(subnet)
    self.prefixlen = net.prefixlen
    self.addresses = [str(net.network_address + i + 1) for i in range(nodes)]
    self.bridge = f"{self.tag}br"
    self.namespaces = [f"{self.tag}n{i}" for i in range(nodes)]
    self.host_veths = [f"{self.tag}v{i}" for i in range(nodes)]
    self.tbf = tbf_params(rate_bits)
    self.commands: list[str] = []  # every command run to build it (for the record)
    self._log = log or (lambda msg: print(f"[cluster] {msg}", file=sys.stderr, flush=True))

  def _run(self, *argv: str, record: bool = True, check: bool = True) -> subprocess.CompletedProcess:
    if record:
      self.commands.append(shlex.join(argv))
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if check and proc.returncode != 0:
      raise RuntimeError(f"`{shlex.join(argv)}` failed ({proc.returncode}): "
                         f"{(proc.stderr or proc.stdout).strip()}")
    return proc

  def tbf_command(self, dev: str, netns: str | None = None) -> list[str]:
    ns = ["-n", netns] if netns else []
    t = self.tbf
    return [self.tc, *ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", t["rate"], "burst",
            t["burst"], "latency", t["latency"]]

  def setup(self) -> None:
    """Builds the bridge, namespaces, links, addresses and shapers."""
    ip = self.ip
    self._log(f"building {self.nodes} namespaces {self.namespaces[0]}..{self.namespaces[-1]} on "
              f"bridge {self.bridge}, links {self.tbf['rate']} each way")
    self._run(ip, "link", "add", self.bridge, "type", "bridge")
    # No address at all on the host side, not even an IPv6 link-local one: the host cannot talk to
    # the nodes and the nodes cannot reach the host.
    self._run(ip, "link", "set", "dev", self.bridge, "addrgenmode", "none")
    self._run(ip, "link", "set", self.bridge, "up")
    for i, (ns, veth, addr) in enumerate(zip(self.namespaces, self.host_veths, self.addresses)):
      peer = f"{self.tag}p{i}"
      self._run(ip, "netns", "add", ns)
      self._run(ip, "link", "add", veth, "type", "veth", "peer", "name", peer)
      self._run(ip, "link", "set", peer, "netns", ns)
      self._run(ip, "-n", ns, "link", "set", peer, "name", NS_INTERFACE)
      self._run(ip, "link", "set", veth, "master", self.bridge)
      self._run(ip, "link", "set", "dev", veth, "addrgenmode", "none")
      self._run(ip, "link", "set", veth, "up")
      self._run(ip, "-n", ns, "addr", "add", f"{addr}/{self.prefixlen}", "dev", NS_INTERFACE)
      self._run(ip, "-n", ns, "link", "set", "lo", "up")
      self._run(ip, "-n", ns, "link", "set", NS_INTERFACE, "up")
      self._run(*self.tbf_command(NS_INTERFACE, ns))   # what node i sends
      self._run(*self.tbf_command(veth))                 # what node i receives
    for ns in self.namespaces:                           # the namespace has no way out
      routes = self._run(ip, "-n", ns, "route", "show", record=False).stdout
      if "default" in routes:
        raise RuntimeError(f"namespace {ns} has a default route: {routes!r}")
    for dev in (self.bridge, *self.host_veths):           # and the host no way in
      addrs = self._run(ip, "-o", "addr", "show", "dev", dev, record=False).stdout.strip()
      if addrs:
        raise RuntimeError(f"host-side device {dev} has an address: {addrs!r}")
    self._wait_reachable()

  def _wait_reachable(self, timeout: float = 10.0) -> None:
    """Waits until node 0 can reach every other node (bridge ports forwarding, addresses ready)."""
    deadline = time.monotonic() + timeout
    for addr in self.addresses[1:]:
      while True:
        proc = self._run(self.ip, "netns", "exec", self.namespaces[0], sys.executable, "-c",
                         "import socket, sys\n"
                         "s = socket.socket(socket.AF_INET, socket.SOCK_STREAM); s.settimeout(1)\n"
                         "try: s.connect((sys.argv[1], 9))\n"
                         "except ConnectionRefusedError: sys.exit(0)\n"
                         "except OSError: sys.exit(1)\n", addr, record=False, check=False)
        if proc.returncode == 0:
          break
        if time.monotonic() > deadline:
          raise RuntimeError(f"node address {addr} unreachable from {self.namespaces[0]} after "
                             f"{timeout:g} s")
        time.sleep(0.2)

  def qdisc_report(self) -> list[str]:
    """``tc qdisc show`` of every shaped device (for the record)."""
    lines = []
    for ns, veth in zip(self.namespaces, self.host_veths):
      for argv in ([self.tc, "-n", ns, "qdisc", "show", "dev", NS_INTERFACE],
                   [self.tc, "qdisc", "show", "dev", veth]):
        out = self._run(*argv, record=False, check=False).stdout.strip()
        lines.append(f"{ns if '-n' in argv else 'host'} {argv[-1]}: {out}")
    return lines

  def link_check(self, seconds: float = 0.5) -> dict[str, Any]:
    """TCP transfers of ~``seconds`` at the rate on every link at once: node i sends to node
    (i+1) mod N, so every node's uplink and downlink (both shapers of every veth) carry one flow.

    Each receiver times its first to its last byte; ``ratio_to_rate`` is the slowest flow's rate
    over the link rate.
    """
    nbytes = int(min(max(self.rate_bits / 8 * seconds, 1 << 20), 256 << 20))
    port = DEFAULT_PORT + 1
    n = self.nodes
    sinks: list[subprocess.Popen] = []
    sources: list[subprocess.Popen] = []
    try:
      for i in range(n):
        sink = subprocess.Popen([self.ip, "netns", "exec", self.namespaces[i], sys.executable, "-c",
                                 _SINK, self.addresses[i], str(port)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        sinks.append(sink)
        if sink.stdout.readline().strip() != "ready":
          raise RuntimeError(f"link check: receiver on node {i} did not start: "
                             f"{sink.stderr.read()}")
      for i in range(n):
        sources.append(subprocess.Popen(
            [self.ip, "netns", "exec", self.namespaces[i], sys.executable, "-c", _SOURCE,
             self.addresses[(i + 1) % n], str(port), str(nbytes)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
      for i, src in enumerate(sources):
        _, err = src.communicate(timeout=120)
        if src.returncode != 0:
          raise RuntimeError(f"link check: sender on node {i} failed: {err.strip()}")
      flows = []
      for i, sink in enumerate(sinks):
        out, err = sink.communicate(timeout=60)
        got, secs = out.split()
        got, secs = int(got), float(secs)
        if got != nbytes:
          raise RuntimeError(f"link check: node {(i - 1) % n} sent {nbytes} bytes to node {i}, "
                             f"which received {got}")
        flows.append(dict(src=(i - 1) % n, dst=i, bytes=got, seconds=secs,
                          measured_bits_per_s=got * 8 / secs))
    finally:
      for proc in sinks + sources:
        if proc.poll() is None:
          proc.kill()
          proc.wait()
    rates = [f["measured_bits_per_s"] for f in flows]
    return dict(pattern=f"ring: node i -> node (i+1) mod {n}, all at once", bytes_per_flow=nbytes,
                flows=flows, min_bits_per_s=min(rates), max_bits_per_s=max(rates),
                ratio_to_rate=min(rates) / self.rate_bits)

  def metadata(self) -> dict[str, Any]:
    return dict(nodes=self.nodes, rate=self.tbf["rate"], rate_bits_per_s=self.rate_bits,
                tc=dict(qdisc="tbf", **self.tbf,
                        where="root qdisc on both ends of each node's veth: the namespace end "
                              "(egress of the node) and the host end on the bridge (ingress)"),
                tag=self.tag, bridge=self.bridge, namespaces=self.namespaces,
                interface=NS_INTERFACE, addresses=self.addresses,
                subnet=f"{ipaddress.IPv4Network(f'{self.addresses[0]}/{self.prefixlen}', strict=False)}",
                setup_commands=self.commands)

  def teardown(self) -> list[str]:
    """Kills what runs in the namespaces and deletes them, the veths and the bridge (the qdiscs go
    with their devices). Returns what is left (empty on success); never raises."""
    return remove(self.ip, self.namespaces, [*self.host_veths, self.bridge])


# -- teardown and --cleanup -------------------------------------------------------------------------

def _list_netns(ip: str) -> list[str]:
  out = subprocess.run([ip, "netns", "list"], capture_output=True, text=True).stdout
  return [line.split()[0] for line in out.splitlines() if line.strip()]


def _list_links(ip: str) -> list[str]:
  out = subprocess.run([ip, "-o", "link", "show"], capture_output=True, text=True).stdout
  names = []
  for line in out.splitlines():
    parts = line.split(":", 2)
    if len(parts) >= 2:
      names.append(parts[1].strip().split("@")[0])
  return names


def _kill_in_netns(ip: str, ns: str) -> None:
  """SIGKILLs every process inside namespace ``ns`` (they are this tool's: it made the namespace)."""
  for _ in range(20):
    out = subprocess.run([ip, "netns", "pids", ns], capture_output=True, text=True).stdout
    pids = [int(p) for p in out.split() if p.isdigit() and int(p) != os.getpid()]
    if not pids:
      return
    for pid in pids:
      try:
        os.kill(pid, signal.SIGKILL)
      except (ProcessLookupError, PermissionError):
        pass
    time.sleep(0.1)


def remove(ip: str, namespaces: Sequence[str], links: Sequence[str]) -> list[str]:
  """Deletes the named namespaces (killing what runs there) and host links; returns what is left."""
  existing_ns = set(_list_netns(ip))
  for ns in namespaces:
    if ns in existing_ns:
      _kill_in_netns(ip, ns)
      subprocess.run([ip, "netns", "del", ns], capture_output=True)
  existing_links = set(_list_links(ip))
  for link in links:
    if link in existing_links:
      subprocess.run([ip, "link", "del", link], capture_output=True)
  left = [ns for ns in _list_netns(ip) if ns in set(namespaces)]
  left += [link for link in _list_links(ip) if link in set(links)]
  return left


def _name_pattern(prefix: str) -> re.Pattern:
  return re.compile(rf"{re.escape(prefix)}(\d+)(?:br|v\d+|p\d+|n\d+)")


def leftovers(ip: str, prefix: str = DEFAULT_PREFIX) -> dict[str, list[str]]:
  """Namespaces and host links whose names this tool makes with ``prefix``."""
  pat = _name_pattern(_check_prefix(prefix))
  return dict(namespaces=[n for n in _list_netns(ip) if pat.fullmatch(n)],
              links=[n for n in _list_links(ip) if pat.fullmatch(n)])


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def cleanup(ip: str, prefix: str = DEFAULT_PREFIX, force: bool = False,
            log=print) -> tuple[list[str], list[str]]:
  """Removes leftovers with ``prefix`` of runs whose process is gone (all of them with ``force``).
  Returns (removed, kept)."""
  pat = _name_pattern(_check_prefix(prefix))
  found = leftovers(ip, prefix)
  ns_rm, link_rm, kept = [], [], []
  for kind, names in found.items():
    for name in names:
      pid = int(pat.fullmatch(name).group(1))
      if not force and _pid_alive(pid):
        kept.append(name)
        continue
      (ns_rm if kind == "namespaces" else link_rm).append(name)
  left = remove(ip, ns_rm, link_rm)
  removed = [n for n in ns_rm + link_rm if n not in left]
  for name in removed:
    log(f"removed {name}")
  for name in kept:
    log(f"kept {name}: its run (pid {pat.fullmatch(name).group(1)}) is alive; --force removes it")
  for name in left:
    log(f"could not remove {name}")
  return removed, kept + left


# -- running ------------------------------------------------------------------------------------------

class Session:
  """A built cluster, handed to the body of :func:`run_in_cluster`: its metadata (``meta``, the
  ``metadata.cluster`` of the JSON) and :meth:`run_nodes` to run a program on every node."""

  def __init__(self, cluster: Cluster, meta: dict[str, Any], ip: str, cpus: list[int] | None,
               args: argparse.Namespace):
    self.cluster, self.meta, self.ip, self.cpus, self.args = cluster, meta, ip, cpus, args

  def run_nodes(self, exe: str, argv: Sequence[str], *, label: str,
                launch_command: str | None = None, env: dict[str, str] | None = None) -> int:
    """Runs ``exe argv...`` once per node (rank i in namespace i, pinned to its CPU if pinning),
    joined by the launcher's environment (coordinator on node 0, gloo on eth0) plus ``env``;
    returns the exit status. Each run's command, wall time, status and load averages go to
    ``meta["runs"]``. Raises :class:`_Stop` when the launcher was interrupted (Ctrl-C, SIGTERM), so
    that the caller's body ends and :func:`run_in_cluster` tears down."""
    args, cluster = self.args, self.cluster
    cluster._log(f"running `{label}` on {args.nodes} nodes (coordinator {cluster.addresses[0]}:"
                 f"{args.port}, gloo on {NS_INTERFACE}; {self.meta['placement']})")
    record = dict(command=label, load_average_before=list(os.getloadavg()))
    start = time.monotonic()
    # launch() handles SIGTERM itself while it runs (kills the processes, returns 143) and
    # Ctrl-C (returns 130); run_in_cluster tears the cluster down in every case.
    cpus = ",".join(str(c) for c in self.cpus) if self.cpus else ""
    elastic = bool(getattr(args, "elastic", False))
    # The coordination service as a process of its own (launch's, in the recoverability mode, so
    # that node 0's death is an ordinary loss), reachable from the nodes only inside a namespace:
    # node 0's.
    service = subprocess.Popen(
        [self.ip, "netns", "exec", cluster.tag + "n0", sys.executable, "-m",
         "jax_qcomm.tools.coordinator", "-n", str(args.nodes), "--port", str(args.port)],
        stdout=subprocess.PIPE, text=True)
    service.stdout.readline()  # "coordination service for N workers on ..."
    try:
      status = launch.launch(
          ["-c", _NODE_STUB, self.ip, cluster.tag, cpus, exe, *argv], args.nodes,
          local_devices=args.local_devices, port=args.port, host=cluster.addresses[0],
          interface=NS_INTERFACE, timeout=args.timeout, env=env,
          launch_command=launch_command or label, malloc=getattr(args, "malloc", "reuse"),
          elastic=elastic, max_restarts=getattr(args, "max_restarts", None) if elastic else None,
          service=False)
    finally:
      service.terminate()
      service.wait(timeout=30)
    record.update(wall_s=time.monotonic() - start, exit_status=status,
                  load_average_after=list(os.getloadavg()))
    self.meta.setdefault("runs", []).append(record)
    if status in (130, 128 + signal.SIGTERM):  # launch() caught Ctrl-C / SIGTERM: stop the body too
      raise _Stop(status - 128)
    if status != 0:
      cluster._log(f"`{label}` failed with exit status {status}")
    return status


def run_in_cluster(args: argparse.Namespace, body: Callable[[Session], int]) -> int:
  """Builds the cluster of ``args`` (nodes, rate, pin, prefix, subnet, link check), calls
  ``body(session)`` and returns its status; tears everything down whatever happens (signals
  included: 128 + signal number; 1 when setup or the link check fails)."""
  ip, tc = preflight()
  cpus, placement = node_cpus(args.nodes, getattr(args, "pin", "auto"))
  cluster = Cluster(args.nodes, args.rate, ip=ip, tc=tc, prefix=args.prefix, subnet=args.subnet)

  def on_signal(signum, frame):
    raise _Stop(signum)

  handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
  in_main = threading.current_thread() is threading.main_thread()
  previous = {s: signal.getsignal(s) for s in handled} if in_main else {}
  for s in previous:
    signal.signal(s, on_signal)
  status = 1
  try:
    cluster.setup()
    meta = cluster.metadata()
    meta.update(qdiscs=cluster.qdisc_report(), pin=getattr(args, "pin", "auto"), node_cpus=cpus,
                placement=placement, host_cpus=sorted(os.sched_getaffinity(0)))
    if not args.no_link_check:
      check = cluster.link_check()
      meta["link_check"] = check
      cluster._log(f"link check, {args.nodes} flows at once (ring), "
                   f"{check['bytes_per_flow'] / 1e6:.1f} MB each: "
                   f"{check['min_bits_per_s'] / 1e6:.0f}-{check['max_bits_per_s'] / 1e6:.0f} Mbit/s "
                   f"per flow (slowest {100 * check['ratio_to_rate']:.0f}% of {cluster.tbf['rate']})")
    status = body(Session(cluster, meta, ip, cpus, args))
  except _Stop as e:
    cluster._log(f"signal {signal.Signals(e.signum).name}: tearing down")
    status = 128 + e.signum
  except KeyboardInterrupt:
    cluster._log("interrupted: tearing down")
    status = 130
  except Exception as e:  # setup, link check or the body failed: report, then tear down
    cluster._log(f"error: {type(e).__name__}: {e}")
    status = 1
  finally:
    # A second signal must not interrupt the teardown.
    for s in previous:
      signal.signal(s, signal.SIG_IGN)
    left = cluster.teardown()
    for s, h in previous.items():
      signal.signal(s, h)
    if left:
      cluster._log(f"teardown left {left}; run `{PROG} --cleanup "
                   f"--prefix {args.prefix} --force`")
      status = status or 1
    else:
      cluster._log(f"removed {cluster.tag}*: namespaces, veths, bridge, qdiscs")
  return status


def run(args: argparse.Namespace, program: list[str], command: Sequence[str]) -> int:
  """Builds the cluster, runs ``python program...`` on every node, writes rank 0's JSON to
  ``args.out`` (if given), tears everything down."""
  tmpdir = tempfile.mkdtemp(prefix="qcomm-cluster-")
  rank0_json = os.path.join(tmpdir, "rank0.json")
  exe = getattr(args, "python", None) or sys.executable
  label = shlex.join([exe if exe != sys.executable else "python", *program])
  argv = [*program, "--out", rank0_json] if args.out else program

  def body(session: Session) -> int:
    meta = session.meta
    status = session.run_nodes(exe, argv, label=label, launch_command=shlex.join(command))
    last = meta["runs"][-1]
    meta.update(benchmark_wall_s=last["wall_s"], benchmark_command=label, exit_status=status,
                load_average_before=last["load_average_before"],
                load_average_after=last["load_average_after"])
    if status != 0 or not args.out:
      return status
    if not os.path.exists(rank0_json):
      session.cluster._log(f"the program exited 0 but wrote no JSON ({label}: does it take --out?)")
      return 1
    with open(rank0_json, encoding="utf-8") as f:
      data = json.load(f)
    data.setdefault("metadata", {})["cluster"] = meta
    data["metadata"]["cluster_command"] = shlex.join(command)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
      f.write(json.dumps(data, indent=2, allow_nan=False) + "\n")
    session.cluster._log(f"wrote {args.out}")
    return 0

  try:
    return run_in_cluster(args, body)
  finally:
    shutil.rmtree(tmpdir, ignore_errors=True)


def execute(args: argparse.Namespace, program: list[str], command: Sequence[str],
            prog: str = PROG) -> int:
  """After :func:`validate`: ``--cleanup``, or :func:`run`; exit 69 when the machine cannot."""
  try:
    ip, _ = preflight()
  except Unavailable as e:
    print(f"{prog}: cannot build the simulated cluster here: {e}", file=sys.stderr)
    return EXIT_UNAVAILABLE
  if args.cleanup:
    removed, kept = cleanup(ip, args.prefix, args.force,
                            log=lambda m: print(f"[cluster] {m}", file=sys.stderr))
    if not removed and not kept:
      print(f"[cluster] nothing to clean up (prefix {args.prefix!r})", file=sys.stderr)
    return 0
  return run(args, program, command)


def main(argv: Sequence[str] | None = None) -> int:
  """``python -m jax_qcomm.tools.cluster [options] -- program [args ...]``; returns the exit status."""
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = argparse.ArgumentParser(
      prog=PROG, usage="%(prog)s --nodes N --rate RATE [options] -- PROGRAM [args ...]",
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  add_arguments(parser)
  args = parser.parse_args(argv)
  try:
    program = validate(args)
  except ValueError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return EXIT_USAGE
  return execute(args, program, ["python", "-m", "jax_qcomm.tools.cluster", *argv])


if __name__ == "__main__":
  sys.exit(main())
