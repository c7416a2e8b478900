"""docs/deploy/: the Kubernetes manifests docs/deployment.md explains, checked without a cluster.

Every YAML document of every file there is read with ``yaml.safe_load_all``. Each kind must have what a cluster
needs of it (apiVersion, kind, metadata.name, and its spec); every container runs a ``jaxserve`` command that
jaxserve's own parser accepts, words as written (a renamed or mistyped flag fails here); accelerator containers
ask for their chips and the command's parallelism uses them all; probes ask for a route the app answers 200 on,
without credentials, on the port ``--port`` opens; the startup probe's budget is the one docs/deployment.md gives
for that manifest, at least SIZING_FACTOR times its start-to-healthy time there; Services and InferencePools select
the pods that serve HTTP, and only those, on their ``--port``. No model, no engine: the app runs on an idle stand-in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "docs" / "deploy"
GUIDE = ROOT / "docs" / "deployment.md"
FILES = sorted(p for p in DEPLOY.glob("*") if p.suffix in (".yaml", ".yml"))

# The kinds the manifests may use, and their API versions. A new kind needs its checks here first.
KINDS = {
    "Deployment": "apps/v1",
    "Service": "v1",
    "LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1",
    "InferencePool": "inference.networking.k8s.io/v1",
    "HTTPRoute": "gateway.networking.k8s.io/v1",
}
ACCELERATORS = ("google.com/tpu", "nvidia.com/gpu")
TPU_ACCELERATOR, TPU_TOPOLOGY = "cloud.google.com/gke-tpu-accelerator", "cloud.google.com/gke-tpu-topology"
# Labels LeaderWorkerSet puts on the pods it makes (its API's SetNameLabelKey and WorkerIndexLabelKey).
LWS_NAME, LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/name", "leaderworkerset.sigs.k8s.io/worker-index"
LWS_EXCLUSIVE = "leaderworkerset.sigs.k8s.io/exclusive-topology"
SIZING_FACTOR = 2  # docs/deployment.md: the startup probe waits at least twice the expected start-to-healthy time
LOOPBACK = {"127.0.0.1", "localhost", "::1"}
NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # a DNS-1123 label


@dataclasses.dataclass(frozen=True)
class Doc:
    path: Path
    index: int
    body: dict

    @property
    def id(self) -> str:
        return f"{self.path.name}#{self.index}:{self.body.get('kind')}"

    @property
    def kind(self) -> str:
        return self.body.get("kind")

    @property
    def name(self) -> str:
        return (self.body.get("metadata") or {}).get("name")


def _docs() -> list[Doc]:
    out = []
    for path in FILES:
        with path.open() as f:
            out += [Doc(path, i, body) for i, body in enumerate(yaml.safe_load_all(f)) if body is not None]
    return out


DOCS = _docs()


@dataclasses.dataclass(frozen=True)
class Pods:
    """One pod template of a workload, with the labels its pods get."""

    doc: Doc
    role: str  # "pod" (a Deployment's), "leader" or "worker" (a LeaderWorkerSet's)
    labels: dict
    spec: dict
    hosts: int  # the pods that run one jaxserve process group together: a LeaderWorkerSet's size, else 1

    @property
    def id(self) -> str:
        return f"{self.doc.path.name}:{self.doc.name}:{self.role}"

    @property
    def serves_http(self) -> bool:
        """Process 0 serves HTTP; a LeaderWorkerSet's workers (processes 1, 2, ...) follow its steps."""
        return self.role != "worker"


def _pod_templates(doc: Doc) -> list[Pods]:
    spec = doc.body.get("spec") or {}
    if doc.kind == "Deployment":
        t = spec["template"]
        return [Pods(doc, "pod", dict(t["metadata"]["labels"]), t["spec"], 1)]
    if doc.kind == "LeaderWorkerSet":
        group = spec["leaderWorkerTemplate"]
        size, worker = group.get("size", 1), group["workerTemplate"]
        leader = group.get("leaderTemplate", worker)
        leader_labels = {**leader["metadata"]["labels"], LWS_NAME: doc.name, LWS_WORKER_INDEX: "0"}
        pods = [Pods(doc, "leader", leader_labels, leader["spec"], size)]
        if size > 1:
            pods.append(Pods(doc, "worker", {**worker["metadata"]["labels"], LWS_NAME: doc.name}, worker["spec"], size))
        return pods
    return []


PODS = [p for d in DOCS for p in _pod_templates(d)]
CONTAINERS = [(p, c) for p in PODS for c in p.spec["containers"]]


def _container_id(item) -> str:
    pods, container = item
    return f"{pods.id}:{container['name']}"


def _jaxserve_argv(container: dict) -> list[str]:
    """The jaxserve command's arguments, words as written (Kubernetes' $(VAR) and the shell's $VAR stay unexpanded,
    so a flag that needs them does not parse); with ``sh -c LINE``, the jaxserve command of LINE."""
    words = [*container.get("command", []), *container.get("args", [])]
    assert words and all(isinstance(w, str) for w in words), f"command and args must be strings: {words}"
    if Path(words[0]).name in ("sh", "bash") and "-c" in words:
        lexer = shlex.shlex(words[words.index("-c") + 1], posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        commands, command = [], []
        for token in [*lexer, ";"]:  # the line's simple commands
            if token in (";", "&&", "||", "|", "&"):
                commands.append(command)
                command = []
            else:
                command.append(token)
        words = next((c for c in commands if _start(c) is not None), [])
    start = _start(words)
    assert start is not None, f"no jaxserve command in {words}"
    return words[start:]


def _start(words: list[str]) -> int | None:
    """Where the arguments of ``[exec] jaxserve ...`` / ``python -m jaxserve[.cli] ...`` begin in ``words``."""
    for i, w in enumerate(words):
        if Path(w).name == "jaxserve":
            return i + 1
        if Path(w).name.startswith("python") and words[i + 1 : i + 3] in (["-m", "jaxserve"], ["-m", "jaxserve.cli"]):
            return i + 3
    return None


def _parse(container: dict):
    from jaxserve.cli import build_parser

    argv, error = _jaxserve_argv(container), io.StringIO()
    try:
        with contextlib.redirect_stderr(error):
            return build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"jaxserve {shlex.join(argv)} does not parse: {error.getvalue().strip().splitlines()[-1]}")


def _matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _container_port(container: dict, port) -> int:
    """A probe's or Service's port (a number or a container port's name) as a number."""
    if isinstance(port, int):
        return port
    named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    assert port in named, f"no container port named {port!r} (ports: {named})"
    return named[port]


def _guide_table() -> dict[str, dict[str, str]]:
    """docs/deployment.md's table of start-to-healthy times and startup budgets: {manifest file name: row}."""
    rows, header = {}, None
    for line in GUIDE.read_text().splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set("".join(cells)) <= set("-: "):
            names = re.findall(r"deploy/([\w.-]+\.ya?ml)", cells[0])
            if names and "startupProbe budget (s)" in header:
                rows[names[0]] = dict(zip(header, cells))
    return rows


def _seconds(cell: str) -> int:
    return int(re.match(r"[\d,]+", cell).group().replace(",", ""))


class IdleEngine:
    """What build_app needs of an engine, serving nothing: /health answers as it does on a loaded model."""

    model_name = "idle"
    model_config = SimpleNamespace(vocab_size=100)
    scheduler_config = SimpleNamespace(max_model_len=64)
    tokenizer = SimpleNamespace(eos_token_ids=(0,))

    def add_request(self, *args, **kwargs):
        raise AssertionError("a probe sent a request to the engine")

    def abort_request(self, request_id):
        return False

    def has_unfinished_requests(self):
        return False

    def get_stats(self):
        return {}

    def step(self):
        return []


# ----------------------------------------------------------------------------------------------------- the files
def test_the_manifests_are_there_and_documented():
    kinds = {d.kind for d in DOCS}
    assert {"LeaderWorkerSet", "Deployment", "Service", "InferencePool"} <= kinds, kinds
    guide = GUIDE.read_text()
    for path in FILES:
        assert f"(deploy/{path.name})" in guide, f"docs/deployment.md does not link deploy/{path.name}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.id)
def test_document_has_the_fields_of_its_kind(doc):
    body = doc.body
    assert doc.kind in KINDS, f"{doc.id}: kind {doc.kind!r} has no checks here (known: {sorted(KINDS)})"
    assert body.get("apiVersion") == KINDS[doc.kind], f"{doc.id}: apiVersion {body.get('apiVersion')!r}"
    assert doc.name and NAME.match(doc.name) and len(doc.name) <= 63, f"{doc.id}: metadata.name {doc.name!r}"
    spec = body.get("spec")
    assert isinstance(spec, dict) and spec, f"{doc.id}: no spec"
    if doc.kind == "Deployment":
        selector = spec["selector"]["matchLabels"]
        own = [p for p in PODS if _matches(selector, p.labels)]
        assert [p.doc for p in own] == [doc], f"{doc.id}: its selector must match its own pods only: {own}"
    elif doc.kind == "LeaderWorkerSet":
        group = spec["leaderWorkerTemplate"]
        assert isinstance(group.get("size"), int) and group["size"] >= 1 and "workerTemplate" in group
        if group["size"] > 1:  # a jax.distributed group cannot take a restarted process back
            assert group.get("restartPolicy", "RecreateGroupOnPodRestart") == "RecreateGroupOnPodRestart"
            annotations = body["metadata"].get("annotations") or {}  # a group's hosts on one slice (GKE node pool)
            assert annotations.get(LWS_EXCLUSIVE) == "cloud.google.com/gke-nodepool", f"{doc.id}: {LWS_EXCLUSIVE}"
    elif doc.kind == "Service":
        assert spec.get("selector") and spec.get("ports"), f"{doc.id}: a Service needs a selector and ports"
        assert all(isinstance(p.get("port"), int) for p in spec["ports"])
    elif doc.kind == "InferencePool":
        assert spec["selector"].get("matchLabels"), f"{doc.id}: selector.matchLabels"
        numbers = [p["number"] for p in spec["targetPorts"]]
        assert 1 <= len(numbers) <= 8 and len(set(numbers)) == len(numbers), f"{doc.id}: targetPorts {numbers}"
        picker = spec["endpointPickerRef"]
        assert picker.get("name") and picker.get("kind", "Service") == "Service"
        assert isinstance(picker["port"]["number"], int), f"{doc.id}: a Service picker needs port.number"
        assert picker.get("failureMode", "FailClose") in ("FailOpen", "FailClose")
    elif doc.kind == "HTTPRoute":
        assert spec.get("parentRefs") and spec.get("rules"), f"{doc.id}: an HTTPRoute needs parentRefs and rules"
        pools = {d.name for d in DOCS if d.kind == "InferencePool"}
        for rule in spec["rules"]:
            for ref in rule["backendRefs"]:
                if ref.get("kind") == "InferencePool":
                    assert ref.get("group") == "inference.networking.k8s.io" and ref["name"] in pools, ref


# ------------------------------------------------------------------------------------------------ the containers
@pytest.mark.parametrize("item", CONTAINERS, ids=_container_id)
def test_container_runs_a_jaxserve_command_that_parses(item):
    pods, container = item
    assert container.get("image"), f"{pods.id}: no image"
    args = _parse(container)
    assert args.command == "serve", f"{pods.id}: runs jaxserve {args.command}, not serve"
    if pods.serves_http:
        assert args.host not in LOOPBACK, f"{pods.id}: --host {args.host} is unreachable from other pods"


@pytest.mark.parametrize("item", CONTAINERS, ids=_container_id)
def test_container_asks_for_the_chips_its_command_uses(item):
    pods, container = item
    args = _parse(container)
    resources = container.get("resources", {})
    limits, requests = resources.get("limits", {}), resources.get("requests", {})
    asked = [a for a in ACCELERATORS if a in limits or a in requests]
    assert len(asked) <= 1, f"{pods.id}: asks for {asked}"
    chips = 1  # the CPU: one device per process
    if asked:
        chips = limits.get(asked[0])
        assert isinstance(chips, int) and chips >= 1, f"{pods.id}: limits[{asked[0]}] = {chips!r}"
        assert requests.get(asked[0], chips) == chips, f"{pods.id}: requests and limits of {asked[0]} differ"
    devices = chips * pods.hosts
    used = args.tensor_parallel_size * args.data_parallel_size
    assert used == devices, f"{pods.id}: {used} devices in the command, {chips} x {pods.hosts} hosts asked for"
    if asked == ["google.com/tpu"]:
        selector = pods.spec.get("nodeSelector", {})
        assert TPU_ACCELERATOR in selector and TPU_TOPOLOGY in selector, f"{pods.id}: TPU node selectors"
        dims = [int(d) for d in str(selector[TPU_TOPOLOGY]).split("x")]
        slice_chips = 1
        for d in dims:
            slice_chips *= d
        assert slice_chips == devices, f"{pods.id}: topology {selector[TPU_TOPOLOGY]} is {slice_chips} chips"
    explicit = (args.coordinator, args.num_processes, args.process_id)
    if pods.hosts > 1:  # one command for every pod of the group: each process finds its own id
        assert args.distributed_auto and explicit == (None,) * 3, f"{pods.id}: needs --distributed-auto only"
    else:
        assert not args.distributed_auto and explicit == (None,) * 3, f"{pods.id}: one host, no process group"


@pytest.mark.parametrize("doc", [d for d in DOCS if d.kind == "LeaderWorkerSet"], ids=lambda d: d.id)
def test_every_pod_of_a_group_runs_the_same_command(doc):
    """Every process builds the same mesh and model: the leader's and the workers' commands and images agree."""
    pods = [p for p in PODS if p.doc == doc]
    commands = {tuple(_jaxserve_argv(c)) for p in pods for c in p.spec["containers"]}
    images = {c["image"] for p in pods for c in p.spec["containers"]}
    assert len(commands) == 1 and len(images) == 1, f"{doc.id}: {commands} {images}"


# ---------------------------------------------------------------------------------------------------- the probes
@pytest.mark.parametrize("item", CONTAINERS, ids=_container_id)
def test_probes_ask_the_app_on_its_port(item):
    from fastapi.testclient import TestClient

    from jaxserve.server.app import build_app

    pods, container = item
    args = _parse(container)
    probes = {k: container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container}
    if not pods.serves_http:
        assert not any("httpGet" in p for p in probes.values()), f"{pods.id}: a worker serves no HTTP"
        return
    assert set(probes) == {"startupProbe", "readinessProbe", "livenessProbe"}, f"{pods.id}: probes {set(probes)}"
    app = build_app(IdleEngine(), served_model_names=args.served_model_name, api_key=args.api_key)
    with TestClient(app) as client:
        for kind, probe in probes.items():
            get = probe["httpGet"]
            assert _container_port(container, get["port"]) == args.port, f"{pods.id}: {kind} port != --port"
            response = client.get(get["path"])  # as the kubelet asks: no credentials
            assert response.status_code == 200, f"{pods.id}: {kind} GET {get['path']}: {response.status_code}"
    grace = pods.spec.get("terminationGracePeriodSeconds", 30)
    assert grace > args.shutdown_timeout, f"{pods.id}: SIGKILL after {grace} s, before the drain's end"


@pytest.mark.parametrize("item", [i for i in CONTAINERS if i[0].serves_http], ids=_container_id)
def test_startup_probe_waits_for_load_and_warm_up(item):
    """The kubelet restarts a container whose startup probe fails failureThreshold times in a row, and jaxserve
    answers nothing until its model is loaded and every bucket compiled: the budget must cover that time."""
    pods, container = item
    probe = container["startupProbe"]
    budget = probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
    row = _guide_table().get(pods.doc.path.name)
    assert row, f"docs/deployment.md's table has no row for deploy/{pods.doc.path.name}"
    start, documented = _seconds(row["start to healthy (s)"]), _seconds(row["startupProbe budget (s)"])
    assert budget == documented, f"{pods.id}: the startup probe allows {budget} s, the guide says {documented}"
    assert budget >= SIZING_FACTOR * start, f"{pods.id}: {budget} s < {SIZING_FACTOR} x {start} s to healthy"


# ------------------------------------------------------------------------------------- Services and pools
@pytest.mark.parametrize("doc", [d for d in DOCS if d.kind in ("Service", "InferencePool")], ids=lambda d: d.id)
def test_service_or_pool_selects_the_serving_pods_on_their_port(doc):
    spec = doc.body["spec"]
    selector = spec["selector"] if doc.kind == "Service" else spec["selector"]["matchLabels"]
    selected = [p for p in PODS if _matches(selector, p.labels)]
    assert selected, f"{doc.id}: its selector {selector} matches no pod"
    assert all(p.serves_http for p in selected), f"{doc.id}: selects pods that serve no HTTP: {selected}"
    commands = [(p, c, _parse(c)) for p in selected for c in p.spec["containers"]]
    if doc.kind == "Service":
        for port in spec["ports"]:
            target = port.get("targetPort", port["port"])
            for p, c, args in commands:
                assert _container_port(c, target) == args.port, f"{doc.id}: port {target} is not {p.id}'s --port"
    else:
        for number in (t["number"] for t in spec["targetPorts"]):
            for p, _, args in commands:
                assert number == args.port, f"{doc.id}: target port {number} is not {p.id}'s --port {args.port}"
        served = {(args.model, tuple(args.served_model_name or ())) for _, _, args in commands}
        assert len(served) == 1, f"{doc.id}: a pool's pods must serve one model: {served}"
