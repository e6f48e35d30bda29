"""Campaigns on a simulated Ray cluster (``ray.cluster_utils.Cluster``: a head with no CPU for tasks and two nodes
of one CPU each, on this machine): the merged tables equal the local backend's, a node removed mid-run loses no
combination (its task is retried, attempt 2, and appears once), and a rerun skips what finished. Marker ``ray``
(``make test-ray``, which installs the ray extra); the cheapest honest units: the matrix's ``verify`` step in cached
venvs of the installed transformers beside three trl releases (~20 s each), two fuzz shards of two examples, two zoo
architectures on cb_impl, one conformance property on two engines."""

from __future__ import annotations

import json
import threading
import time

import pytest

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.upstream]

TRLS = ["1.16.0", "1.15.0", "1.14.2"]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    ray.init(address=cluster.address, namespace="cbverify", log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster, workers
    ray.shutdown()
    cluster.shutdown()


def _matrix(out, *extra) -> dict:
    import transformers

    from cbverify.cli import main

    argv = ["matrix", "--transformers", transformers.__version__, "--trl", *TRLS, "--steps", "verify"]
    code = main([*argv, "--out", str(out), *extra])
    payload = json.loads((out / "matrix.json").read_text())
    return {"code": code, **payload}


@pytest.fixture(scope="module")
def local_matrix(tmp_path_factory):
    return _matrix(tmp_path_factory.mktemp("local"), "--jobs", "2")


def test_matrix_on_two_nodes_gives_the_local_tables_and_a_rerun_skips_every_combination(
    cluster, local_matrix, tmp_path, capsys
):
    remote = _matrix(tmp_path, "--ray", cluster[0].address)
    assert (remote["header"], remote["rows"], remote["code"]) == (
        local_matrix["header"], local_matrix["rows"], local_matrix["code"])  # fmt: skip
    assert len(local_matrix["header"]) == 2 + len(TRLS) and any(r[0] == "verify" for r in remote["rows"])
    assert set(remote["attempts"].values()) == {1}
    assert {n["id"] for n in remote["nodes"].values()} == {w.node_id for w in cluster[1]}, "both nodes take work"
    capsys.readouterr()
    again = _matrix(tmp_path, "--ray", cluster[0].address)
    assert f"resuming: {len(TRLS)} of {len(TRLS)} finished before" in capsys.readouterr().out
    assert (again["header"], again["rows"], again["nodes"]) == (remote["header"], remote["rows"], remote["nodes"])


def _attempts_actor(timeout: float = 120):
    """The running campaign's attempt counter (named ``cbverify-attempts-<id>``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith("cbverify-attempts-")]  # fmt: skip
        if names:
            return ray.get_actor(names[0], namespace="cbverify")
        time.sleep(0.5)
    raise AssertionError("no campaign started")


def test_a_node_removed_mid_combination_loses_nothing_its_task_runs_again_elsewhere(cluster, local_matrix, tmp_path):
    head, workers = cluster
    box = {}
    driver = threading.Thread(target=lambda: box.update(_matrix(tmp_path, "--ray", head.address)))
    driver.start()
    counter = _attempts_actor()
    while len(ray.get(counter.counts.remote())) < 2:  # one combination running on each node
        time.sleep(0.5)
    time.sleep(3)
    head.remove_node(workers[1])
    driver.join(timeout=600)
    cluster[1][1] = head.add_node(num_cpus=1)  # the next test gets two nodes again
    assert box, "the campaign did not finish"
    assert box["header"] == local_matrix["header"], "every combination exactly once"
    assert box["rows"] == local_matrix["rows"] and box["code"] == local_matrix["code"]
    print("attempts:", box["attempts"], "nodes:", {k: n["id"][:8] for k, n in box["nodes"].items()})
    assert sorted(box["attempts"].values()) == [1, 1, 2], box["attempts"]
    retried = next(k for k, a in box["attempts"].items() if a == 2)
    assert box["nodes"][retried]["id"] == workers[0].node_id, "the retry ran on the surviving node"


def _fuzz(out, *extra) -> tuple[int, dict]:
    from cbverify.cli import main

    argv = ["fuzz", "--engine", "transformers-cb", "--examples", "2", "--shards", "2", "--shrink-runs", "0"]
    code = main([*argv, "--out", str(out), "--json", str(out / "fuzz.json"), *extra])
    return code, json.loads((out / "fuzz.json").read_text())


def test_fuzz_shards_on_two_nodes_find_the_local_classes(cluster, tmp_path):
    local_code, local = _fuzz(tmp_path / "local")
    code, remote = _fuzz(tmp_path / "ray", "--ray", cluster[0].address)

    def classes(payload):
        return sorted((c["check"], c["finding"], c["not"]) for c in payload["classes"])

    assert classes(remote) == classes(local) and code == local_code
    assert classes(local), "transformers-cb's registered findings show in every case: the comparison is not vacuous"
    assert sorted(s["seed"] for s in remote["shards"]) == [0, 1] and all(s["node"] for s in remote["shards"])
    from cbverify.fuzz.case import FuzzCase

    (cases,) = json.loads((tmp_path / "ray" / "fuzz-examples.json").read_text()).values()
    assert len(cases) >= len(classes(remote)), "each shard's found cases reach the driver's database"
    assert all(FuzzCase.from_json(json.loads(c)).engine == "transformers-cb" for c in cases)


def test_zoo_and_conformance_on_two_nodes_give_the_local_tables(cluster, tmp_path, capsys):
    from cbverify.cli import main

    zoo = ["zoo", "--archs", "llama", "mistral", "--engines", "cb_impl"]
    assert main(zoo) == 0
    local = [ln for ln in capsys.readouterr().out.splitlines() if "cb_impl" in ln]
    assert main([*zoo, "--ray", cluster[0].address, "--out", str(tmp_path / "zoo")]) == 0
    assert [ln for ln in capsys.readouterr().out.splitlines() if "cb_impl" in ln] == local and len(local) == 2
    conformance = ["conformance", "--engines", "cb_impl", "hf-generate", "--examples", "2", "-k", "greedy"]
    code = main([*conformance, "--markdown", str(tmp_path / "local.md")])
    remote = main([*conformance, "--markdown", str(tmp_path / "ray.md"), "--ray", cluster[0].address,
                   "--out", str(tmp_path / "conformance")])  # fmt: skip
    tables = [(tmp_path / f"{name}.md").read_text().splitlines()[3:] for name in ("local", "ray")]
    assert (remote, tables[1]) == (code, tables[0]) and any("hf-generate" in ln for ln in tables[0])
