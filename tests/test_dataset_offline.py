"""task.name = "dataset" sends no request unless task.dataset_download allows it: a name no local cache holds ends in
one line saying how to fetch it, a name in either local Hugging Face cache (the one `datasets` fills, the one
`hf download` fills) loads offline, local files never touch the network, and the option does let a name go to
the Hub. Every test runs with `datasets` and `huggingface_hub` already imported and their offline switches off, as
in a trainer process (they read HF_HUB_OFFLINE from the environment only when imported), and with the host's
name lookups and connections recorded and refused."""

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grpo_kernels.train.build import task_examples
from grpo_kernels.train.config.io import load_config

datasets = pytest.importorskip("datasets")
hub = pytest.importorskip("huggingface_hub.constants")

ROWS = [{"question": f"What is {i} + {i}?", "solution": str(2 * i)} for i in range(8)]
LOOPBACK = ("127.0.0.1", "::1", "localhost")


@pytest.fixture
def requests(monkeypatch, tmp_path):
    """The name lookups and connections that would leave this host, recorded and refused; empty caches; the
    libraries' offline switches off (whatever the environment says)."""
    tried = []
    lookup, connect = socket.getaddrinfo, socket.socket.connect

    def getaddrinfo(host, *args, **kwargs):
        if host not in LOOPBACK:
            tried.append(f"lookup {host}")
            raise socket.gaierror(socket.EAI_NONAME, "the test refuses the network")
        return lookup(host, *args, **kwargs)

    def refuse(sock, address):
        if not (isinstance(address, tuple) and address[0] in LOOPBACK):
            tried.append(f"connect {address}")
            raise ConnectionRefusedError("the test refuses the network")
        return connect(sock, address)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    yield tried
    assert not datasets.config.HF_HUB_OFFLINE and not hub.HF_HUB_OFFLINE, "the offline switches were left on"


def _config(source, *extra):
    return load_config(None, ["task.name=dataset", f"task.dataset={source}", "task.prompt_column=question",
                              "task.answer_column=solution", "task.num_eval_prompts=2", "task.num_train_prompts=6",
                              *extra])  # fmt: skip


def _questions(config) -> set:
    _, train, held_out = task_examples(config)
    return {e.prompt for e in train + held_out}


def test_a_name_no_cache_holds_sends_no_request_and_says_how_to_fetch_it(requests):
    with pytest.raises(ValueError) as error:
        task_examples(_config("tiny-org/not-cached"))
    message = str(error.value)
    assert requests == [], f"requests left for the Hub: {requests}"
    assert "\n" not in message
    assert message.startswith("task.dataset tiny-org/not-cached: not a local file or folder, and no local Hugging "
                              "Face cache holds a dataset of that name (no download was tried)")  # fmt: skip
    assert "`hf download tiny-org/not-cached --repo-type dataset`" in message
    assert "task.dataset_download = true" in message


def test_a_name_in_the_datasets_cache_loads_offline(requests, tmp_path):
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    # What datasets.load_dataset("tiny-org/tinyset") leaves in its cache: the arrow files of each split and
    # dataset_info.json, written by the same builder, under <namespace>___<name>/<config>/<version>/<hash>.
    from datasets.packaged_modules.json.json import Json

    builder = Json(cache_dir=str(tmp_path / "build"), dataset_name="tinyset", config_name="default",
                   data_files={"train": str(source)})  # fmt: skip
    builder.download_and_prepare(output_dir=str(tmp_path / "datasets-cache/tiny-org___tinyset/default/0.0.0/0a1b2c"))
    assert _questions(_config("tiny-org/tinyset")) == {r["question"] for r in ROWS}
    assert requests == [], f"requests left for the Hub: {requests}"


def test_a_name_fetched_with_hf_download_loads_offline(requests, tmp_path):
    # huggingface_hub's cache layout: refs/main names the snapshot that holds the repository's files.
    repo, commit = tmp_path / "hub-cache/datasets--tiny-org--tinyset", "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs/main").write_text(commit)
    (repo / "snapshots" / commit / "data").mkdir(parents=True)
    (repo / "snapshots" / commit / "data/train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert _questions(_config("tiny-org/tinyset")) == {r["question"] for r in ROWS}
    assert requests == [], f"requests left for the Hub: {requests}"


@pytest.mark.parametrize("suffix", [".csv", ".parquet", ".json", "folder"])
def test_local_files_need_no_network(requests, tmp_path, suffix):
    path = tmp_path / ("data" if suffix == "folder" else f"data{suffix}")
    table = datasets.Dataset.from_list(ROWS)
    if suffix == "folder":
        path.mkdir()
        table.to_csv(str(path / "train.csv"), index=False)
    elif suffix == ".csv":
        table.to_csv(str(path), index=False)
    elif suffix == ".parquet":
        table.to_parquet(str(path))
    else:
        path.write_text(json.dumps(ROWS))
    assert _questions(_config(path)) == {r["question"] for r in ROWS}
    assert requests == [], f"requests left for the network: {requests}"


class _Hub(BaseHTTPRequestHandler):
    """A Hub on loopback that knows no repository (as huggingface.co answers for a name it does not have)."""

    seen: list = []

    def _missing(self):
        self.seen.append(f"{self.command} {self.path}")
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = _missing

    def log_message(self, *args):
        pass


def test_task_dataset_download_lets_a_name_go_to_the_hub(requests, monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        monkeypatch.setattr(_Hub, "seen", [])
        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(ValueError, match=r"task.dataset tiny-org/elsewhere: not a local file or folder, and the "
                                             r"Hugging Face Hub has no dataset of that name \(DatasetNotFoundError"):
            task_examples(_config("tiny-org/elsewhere", "task.dataset_download=true"))
        assert any("tiny-org/elsewhere" in seen for seen in _Hub.seen), _Hub.seen
    finally:
        server.shutdown()
        server.server_close()


def test_task_dataset_download_is_refused_for_the_other_tasks():
    with pytest.raises(ValueError, match='task.dataset_download must be false unless task.name is "dataset"'):
        load_config(None, ["task.dataset_download=true"])
