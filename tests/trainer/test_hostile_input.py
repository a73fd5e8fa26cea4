"""Hostile and broken input gets one clear line naming the file or field, no traceback, nothing
written outside the run's place and nothing already saved lost. Each row of README's "Hostile
input" table is a test here (issue 16)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from PIL import Image

from kubetune_cli.main import cli
from kubetune_trainer.data.tiny_data import write_tiny_data
from tests.storage.conftest import s3_server  # noqa: F401 - a fixture, for the missing-bucket row
from tests.trainer.conftest import (copy_of_run, family_job, run_dir, run_trainer, run_trainer_expecting_failure,
                                    run_trainer_on, trainer_command, trainer_env, write_manifest)

pytestmark = pytest.mark.slow


def kubetune(*args: str):
    return CliRunner().invoke(cli, list(args))


def no_traceback(text: str) -> bool:
    return "Traceback (most recent call last)" not in text


# --- data sets: every bad sample named before training, or skipped and counted ------------------

def truncated_png(path: Path) -> None:
    Image.new("RGB", (32, 32), (200, 10, 10)).save(path)
    path.write_bytes(path.read_bytes()[:60])


def not_an_image(path: Path) -> None:
    path.write_bytes(b"GIF89a but not really" * 10)


def decompression_bomb(path: Path) -> None:
    Image.new("1", (12_000, 12_000)).save(path)  # 144 million pixels in a few kilobytes


BAD_CAPTIONS = [
    # (what, how the data set is spoiled, words the refusal must hold)
    ("a truncated image", lambda root: truncated_png(root / "0003.png"), ["0003.png", "cannot be read as an image"]),
    ("a file that is not an image", lambda root: not_an_image(root / "0002.png"),
     ["0002.png", "cannot be read as an image"]),
    ("a decompression bomb", lambda root: decompression_bomb(root / "0001.png"),
     ["0001.png", "larger than", "decompression bomb"]),
    ("a caption line that is not UTF-8", lambda root: rewrite_line(root, 2, b'{"file_name": "0001.png", "text": "caf\xe9"}'),
     ["metadata.jsonl:2", "not UTF-8"]),
    ("a null caption", lambda root: rewrite_line(root, 3, b'{"file_name": "0002.png", "text": null}'),
     ["metadata.jsonl:3", "must be strings", "NoneType"]),
    ("a file name that climbs out of the data set",
     lambda root: rewrite_line(root, 1, b'{"file_name": "../../../etc/hostname", "text": "x"}'),
     ["metadata.jsonl:1", "'../../../etc/hostname' leaves"]),
    ("a symbolic link out of the data set", lambda root: symlink_out(root / "0004.png"),
     ["0004.png", "through a symbolic link"]),
    ("a broken metadata line", lambda root: rewrite_line(root, 5, b'{"file_name": "0004.png", '),
     ["metadata.jsonl:5", 'expected {"file_name": ..., "text": ...}']),
]


def rewrite_line(root: Path, number: int, content: bytes) -> None:
    lines = (root / "metadata.jsonl").read_bytes().splitlines()
    lines[number - 1] = content
    (root / "metadata.jsonl").write_bytes(b"\n".join(lines) + b"\n")


def symlink_out(path: Path) -> None:
    path.unlink()
    outside = path.parent.parent / "outside.png"
    Image.new("RGB", (32, 32)).save(outside)
    os.symlink(outside, path)
    rewrite = (path.parent / "metadata.jsonl").read_text()
    assert path.name in rewrite


@pytest.fixture
def spoiled(tmp_path):
    """spoiled(spoil): a fresh 12-sample captions set, spoiled in one way."""
    def make(spoil) -> Path:
        root = write_tiny_data("captions", tmp_path / "data", count=12, size=32, seed=0)
        spoil(root)
        return root
    return make


@pytest.mark.parametrize("what,spoil,words", BAD_CAPTIONS, ids=[w for w, _, _ in BAD_CAPTIONS])
def test_a_bad_sample_is_refused_before_training_naming_the_file(what, spoil, words, spoiled, tiny_sd15, tmp_path):
    manifest = family_job("sd15", "captions", tiny_sd15, spoiled(spoil), tmp_path / "out")
    result = run_trainer_on(write_manifest(manifest, tmp_path), timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    for word in words:
        assert word in result.stderr, result.stderr[-3000:]
    assert "spec.data.skipBad: true" in result.stderr, "the refusal names the way to skip instead"
    assert no_traceback(result.stderr)
    assert not (tmp_path / "out").exists(), "refused before the run wrote anything"


def test_with_skip_bad_the_bad_samples_are_left_out_counted_and_the_run_trains(spoiled, tiny_sd15, tmp_path):
    def spoil(root: Path) -> None:
        truncated_png(root / "0003.png")
        rewrite_line(root, 2, b'{"file_name": "0001.png", "text": null}')
    manifest = family_job("sd15", "captions", tiny_sd15, spoiled(spoil), tmp_path / "out",
                          data={"skipBad": True}, training={"maxSteps": 2})
    result = run_trainer(manifest, tmp_path)
    assert "2 bad sample(s) skipped" in result.stderr
    assert "skipped " in result.stderr and "0003.png" in result.stderr
    assert (run_dir(tmp_path / "out") / "pytorch_lora_weights.safetensors").is_file()


def test_an_empty_or_undecodable_instruction_of_an_edit_pair_is_named(tiny_model, tmp_path):
    data = write_tiny_data("edit-pairs", tmp_path / "pairs", count=6, size=32, seed=0)
    (data / "training_images" / "0002.txt").write_text("   \n")
    (data / "training_images" / "0004.txt").write_bytes(b"make it \xff red")
    manifest = family_job("flux-kontext", "edit-pairs", tiny_model("flux-kontext"), data, tmp_path / "out")
    result = run_trainer_on(write_manifest(manifest, tmp_path), timeout=300)
    assert result.returncode == 2 and "0002.txt: is empty" in result.stderr, result.stderr[-2000:]
    manifest["spec"]["data"]["skipBad"] = True
    result = run_trainer(manifest, tmp_path)
    assert "2 bad sample(s) skipped" in result.stderr and "0004.txt: not UTF-8 text" in result.stderr


# --- manifests and the command line ------------------------------------------------------------

def example(tmp_path, text: str | bytes) -> Path:
    path = tmp_path / "job.yaml"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def example_text() -> str:
    return Path("manifests/examples/sd15-lora.yaml").read_text()


# Where the example names its job (the YAML error for a key written twice points there and below).
NAME_LINE = example_text().splitlines().index("  name: sd15-lora-demo") + 1


ALIAS_BOMB = "\n".join(["apiVersion: kubetune.dev/v1alpha1", "kind: TrainingJob", "metadata:",
                        "  name: bomb", '  annotations: {a0: &a0 ["x","x","x","x","x","x","x","x","x"]}',
                        *[f"  x{i}: &a{i} [*a{i-1},*a{i-1},*a{i-1},*a{i-1},*a{i-1},*a{i-1},*a{i-1},*a{i-1},*a{i-1}]"
                          for i in range(1, 9)], "spec: {}"])

MANIFESTS = [
    ("a YAML alias bomb", lambda: ALIAS_BOMB, ["YAML aliases (*name) are not accepted"]),
    ("a manifest that is not UTF-8", lambda: example_text().encode() + b"# \xff\xfe\n", ["is not UTF-8 text"]),
    ("a manifest over 1 MiB", lambda: example_text() + "#" + "x" * (1024 * 1024) + "\n",
     ["a TrainingJob manifest is at most 1048576"]),
    ("a namespace that climbs out", lambda: example_text().replace("name: sd15-lora-demo",
                                                                   "name: sd15-lora-demo\n  namespace: ../../x"),
     ["metadata.namespace", "got '../../x'"]),
    ("a misspelled metadata field", lambda: example_text().replace("name: sd15-lora-demo",
                                                                   "name: sd15-lora-demo\n  namspace: team-a"),
     ["metadata.namspace: unknown field; did you mean 'namespace'?"]),
    ("an s3 URI with one slash", lambda: example_text().replace("uri: /data/pets", "uri: s3:/bucket/pets"),
     ["spec.data.uri", "without its two slashes"]),
    ("credentials inside the S3 endpoint", lambda: example_text().replace(
        "spec:\n", "spec:\n  s3: {endpointUrl: 'http://AKIAEXAMPLE:wJalrXUtnFEMI@minio:9000'}\n", 1),
     ["spec.s3.endpointUrl must not carry credentials", "http://***@minio:9000"]),
    ("YAML nested very deep", lambda: example_text() + "x: " + "[" * 5000 + "]" * 5000 + "\n",
     ["nested deeper than 64 levels"]),
    ("a key written twice", lambda: example_text().replace("name: sd15-lora-demo",
                                                           "name: sd15-lora-demo\n  name: other"),
     [f"the key 'name' is written twice in one mapping (first on line {NAME_LINE})", f"line {NAME_LINE + 1}"]),
    ("a bucket name with a trailing newline", lambda: example_text().replace(
        "uri: /data/pets", 'uri: "s3://pets-bucket\\n"'), ["spec.data.uri", "'pets-bucket\\n' is not an S3 bucket"]),
    ("a label value ending in a newline", lambda: example_text().replace(
        "name: sd15-lora-demo", 'name: sd15-lora-demo\n  labels: {team: "a\\n"}'), ["label team", "'a\\n'"]),
]


@pytest.mark.parametrize("what,make,words", MANIFESTS, ids=[w for w, _, _ in MANIFESTS])
def test_a_hostile_manifest_gets_one_clear_error_from_validate_and_train(what, make, words, tmp_path):
    path = example(tmp_path, make())
    for command in (["validate", "-f", str(path)], ["train", "-f", str(path)]):
        result = kubetune(*command)
        assert result.exit_code == 2, (command, result.output)
        for word in words:
            assert word in result.output, result.output
        assert "wJalrXUtnFEMI" not in result.output, "a secret is never echoed"
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception


def test_an_override_that_is_not_yaml_is_one_line_naming_the_flag(tmp_path):
    path = example(tmp_path, example_text())
    result = kubetune("validate", "-f", str(path), "--set", "spec.data.uri=[unclosed")
    assert result.exit_code == 2
    assert "--set spec.data.uri=...: the value is not valid YAML" in result.output
    assert isinstance(result.exception, SystemExit)


def test_a_missing_local_model_path_is_named_not_taken_for_a_hub_id(tiny_job, tmp_path):
    manifest = tiny_job()
    manifest["spec"]["model"]["pretrained"] = str(tmp_path / "no-such-model")
    result = run_trainer_on(write_manifest(manifest, tmp_path), timeout=300)
    assert result.returncode == 2
    assert f"spec.model.pretrained: {tmp_path / 'no-such-model'} does not exist" in result.stderr
    assert no_traceback(result.stderr)


# --- checkpoints: nothing read or written outside, nothing saved lost ---------------------------

@pytest.fixture
def finished_job(sd15_run, tmp_path):
    """A copy of the session's finished 2-step run under tmp_path (the tests damage it): (manifest, run folder)."""
    manifest, out = copy_of_run(sd15_run, tmp_path)
    return manifest, run_dir(out)


def test_a_manifest_listing_a_file_outside_its_checkpoint_is_refused_and_pull_leaves_nothing(finished_job, tmp_path):
    _, run = finished_job
    manifest_path = run / "checkpoint-2" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["../../../../../../etc/hostname"] = {"size": 1, "sha256": "0" * 64}
    manifest_path.write_text(json.dumps(manifest))
    result = kubetune("checkpoints", "pull", str(run), "--step", "2", "-o", str(tmp_path / "pulled"))
    assert result.exit_code == 1, result.output  # what the store holds is wrong, not the command
    assert "did not arrive intact" in result.output and "'../../../../../../etc/hostname' leaves" in result.output
    assert not [p for p in (tmp_path / "pulled").rglob("*") if p.is_file()], "no unverified file is left behind"


def test_a_damaged_checkpoint_pull_leaves_nothing_and_ls_still_lists_the_rest(finished_job, tmp_path):
    _, run = finished_job
    (run / "checkpoint-2" / "scheduler.pt").write_bytes(b"damaged")
    result = kubetune("checkpoints", "pull", str(run), "--step", "2", "-o", str(tmp_path / "pulled"))
    assert result.exit_code == 1 and "scheduler.pt" in result.output
    assert not [p for p in (tmp_path / "pulled").rglob("*") if p.is_file()]
    (run / "checkpoint-2" / "manifest.json").write_text("{not json")
    (run / "run.json").write_text("[1, 2")
    result = kubetune("checkpoints", "ls", str(run.parent))
    assert result.exit_code == 0, result.output
    assert "checkpoint-2" not in result.output, "a checkpoint with a damaged manifest is not offered"


def test_a_run_whose_record_is_unreadable_is_kept_with_its_checkpoints(finished_job, tmp_path):
    manifest, run = finished_job
    (run / "run.json").write_text("{truncated")
    (run / "pytorch_lora_weights.safetensors").unlink()  # as if it had not finished
    result = run_trainer(manifest, tmp_path)
    assert run.is_dir() and (run / "checkpoint-2" / "manifest.json").is_file(), "nothing saved is lost"
    assert "has no readable run.json: kept" in result.stderr
    assert (run_dir(tmp_path / "out", version=1) / "pytorch_lora_weights.safetensors").is_file()


def test_ctrl_c_of_one_process_takes_a_last_checkpoint_and_exits_143(tiny_job, tmp_path):
    manifest = tiny_job(maxSteps=10_000, logEverySteps=1)
    manifest["spec"]["checkpoints"]["everySteps"] = 1_000_000
    process = subprocess.Popen(trainer_command(write_manifest(manifest, tmp_path)), env=trainer_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    for line in process.stderr:
        if "step 6/" in line:
            break
    process.send_signal(signal.SIGINT)
    _, rest = process.communicate(timeout=120)
    assert process.returncode == 143 and "stopped by SIGINT after step" in rest, rest[-2000:]
    assert list(run_dir(tmp_path / "out").glob("checkpoint-*/manifest.json"))


def test_a_full_disk_is_one_line_naming_where_it_could_not_write(tiny_job, tmp_path):
    import resource

    def small_files_only():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))

    result = subprocess.run(trainer_command(write_manifest(tiny_job(maxSteps=2), tmp_path)), env=trainer_env(),
                            capture_output=True, text=True, timeout=300, preexec_fn=small_files_only)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "kubetune trainer: cannot write" in result.stderr and "free space" in result.stderr
    assert no_traceback(result.stderr.split("kubetune trainer: cannot write")[-1])


# --- damaged sharded checkpoints whose manifest was re-sealed: refused naming the file, nothing lost ----

def damaged_copy(sd15_run, tmp_path, damage) -> tuple[dict, Path]:
    """The run copied under tmp_path, checkpoint-2 damaged, and its manifest re-sealed over the damage."""
    from kubetune_trainer.checkpoint import files as checkpoints

    resumed, out = copy_of_run(sd15_run, tmp_path)
    checkpoint = run_dir(out) / "checkpoint-2"
    damage(checkpoint)
    sealed = json.loads((checkpoint / checkpoints.MANIFEST).read_text())
    files = [f for f in checkpoint.rglob("*") if f.is_file() and f.name != checkpoints.MANIFEST]
    sealed["files"] = checkpoints.describe_files(checkpoint, files)
    (checkpoint / checkpoints.MANIFEST).write_text(json.dumps(sealed))
    resumed["spec"]["checkpoints"]["resumeFrom"] = "latest"
    return resumed, checkpoint


def truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


DAMAGED_CHECKPOINTS = [
    # (what, how checkpoint-2 is damaged before its manifest is re-sealed, words the refusal must hold)
    ("a shard gone", lambda c: (c / "state" / "__0_0.distcp").unlink(), ["state/__0_0.distcp is missing"]),
    ("a shard truncated", lambda c: truncate(c / "state" / "__0_0.distcp", 100), ["state/__0_0.distcp is truncated"]),
    (".metadata truncated", lambda c: truncate(c / "state" / ".metadata", 40), ["state/.metadata is truncated"]),
    ("trainer_state.json empty", lambda c: (c / "trainer_state.json").write_text(""),
     ["trainer_state.json is empty or not a trainer state"]),
    ("scheduler.pt gone", lambda c: (c / "scheduler.pt").unlink(), ["scheduler.pt is missing"]),
]


@pytest.mark.parametrize("what,damage,words", DAMAGED_CHECKPOINTS, ids=[row[0] for row in DAMAGED_CHECKPOINTS])
def test_a_damaged_checkpoint_under_a_resealed_manifest_is_refused_naming_the_file(what, damage, words, sd15_run,
                                                                                   tmp_path):
    from kubetune_api.manifest import parse_manifest
    from kubetune_trainer.errors import ConfigError
    from kubetune_trainer.checkpoint.resume import place_run

    resumed, checkpoint = damaged_copy(sd15_run, tmp_path, damage)
    with pytest.raises(ConfigError) as refused:  # what the trainer's main process decides before writing
        place_run(parse_manifest(resumed).spec.checkpoints, "default", "tiny", None)
    message = str(refused.value)
    assert all(word in message for word in [str(checkpoint), *words, "delete it"]), message
    assert "\n" not in message


def test_the_trainer_refuses_a_damaged_checkpoint_in_one_line_and_writes_nothing(sd15_run, tmp_path):
    resumed, checkpoint = damaged_copy(sd15_run, tmp_path, lambda c: (c / "state" / "__0_0.distcp").unlink())
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "out").rglob("*"))
    stderr = run_trainer_expecting_failure(resumed, tmp_path)  # exit 2: bad input, not retried
    assert f"checkpoint {checkpoint} is damaged" in stderr and "state/__0_0.distcp is missing" in stderr
    assert no_traceback(stderr)
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "out").rglob("*")) == before, "nothing written"


# --- the command line: one table answers every error a command did not ------------------------

class NewStorageTrouble(Exception):
    """Stands for an error class kubetune has never seen, raised by a storage library."""


def storage_library_error(base_name: str) -> type[BaseException]:
    """A subclass, new to kubetune, of one of botocore's error classes (as a botocore upgrade brings)."""
    import botocore.exceptions

    base = getattr(botocore.exceptions, base_name)
    return type("BrandNewS3Trouble", (base,), {"fmt": "something new went wrong with S3"})


UNANSWERED = [
    # (what, the error a command raises without catching it, words the one line must hold, exit code)
    ("a storage error class never seen before", lambda: storage_library_error("BotoCoreError")(),
     ["S3 error (something new went wrong with S3)", "AWS_ENDPOINT_URL"], 1),
    ("a connection error class never seen before",
     lambda: storage_library_error("EndpointConnectionError")(endpoint_url="http://127.0.0.1:9"),
     ["cannot reach the S3 endpoint", "AWS_ENDPOINT_URL"], 1),
    ("a file that vanished", lambda: FileNotFoundError(2, "No such file or directory", "/gone/weights.bin"),
     ["/gone/weights.bin: No such file or directory: check the path"], 2),
    ("a bug", lambda: NewStorageTrouble("a surprise"), ["unexpected NewStorageTrouble: a surprise", "a kubetune bug"], 1),
]


@pytest.mark.parametrize("what,error,words,code", UNANSWERED, ids=[w for w, _, _, _ in UNANSWERED])
def test_an_error_no_command_answered_is_one_line_from_the_one_table(what, error, words, code, monkeypatch):
    import kubetune_cli.checkpoints

    def raising(*_args, **_kwargs):
        raise error()

    monkeypatch.setattr(kubetune_cli.checkpoints, "resolve", raising)
    result = kubetune("checkpoints", "ls", "s3://bucket/runs")
    assert result.exit_code == code, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kubetune checkpoints: "), result.output
    for word in words:
        assert word in lines[0], lines[0]


def test_a_step_in_unicode_digits_is_refused_in_one_line(tmp_path):
    for command in (["checkpoints", "pull", str(tmp_path), "-o", str(tmp_path / "o")],
                    ["export", str(tmp_path), "--format", "kohya", "--out", str(tmp_path / "o")]):
        result = kubetune(*command, "--step", "²")
        assert result.exit_code == 2, (command, result.output)
        assert "--step '²': use a step number, latest or final" in result.output, result.output
        assert isinstance(result.exception, SystemExit)


def endpoint_down(request, monkeypatch) -> None:
    from kubetune_api.ports import free_listen_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_listen_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")


def real_store(request, monkeypatch) -> None:
    request.getfixturevalue("s3_server")


S3_TROUBLE = [
    # (what, the store this shell points at, the URI, words the one line must hold)
    ("an S3 endpoint that is down", endpoint_down, "s3://some-bucket/data",
     ["cannot reach the S3 endpoint", "check AWS_ENDPOINT_URL (or spec.s3.endpointUrl)"]),
    ("a bucket that does not exist", real_store, "s3://no-such-bucket-kt/data",
     ["S3 bucket 'no-such-bucket-kt' does not exist", "create the bucket"]),
]


@pytest.mark.parametrize("what,store,uri,words", S3_TROUBLE, ids=[w for w, _, _, _ in S3_TROUBLE])
def test_s3_trouble_is_one_line_from_the_cli_and_the_trainer(what, store, uri, words, request, monkeypatch,
                                                             tiny_job, tmp_path):
    from kubetune_trainer.storage import s3

    store(request, monkeypatch)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # the answer, not botocore's ten retries, is under test
    s3.forget_clients()
    manifest = tiny_job()
    manifest["spec"]["data"]["uri"] = uri
    try:
        listed = kubetune("checkpoints", "ls", uri)
        trained = kubetune("train", "-f", str(write_manifest(manifest, tmp_path)))
    finally:
        s3.forget_clients()
    assert listed.exit_code == 1 and f"kubetune checkpoints: cannot read {uri}: " in listed.output, listed.output
    assert trained.exit_code == 1, trained.output[-2000:]
    said = [line for line in trained.output.splitlines() if line.startswith("kubetune trainer: ")]
    assert len(said) == 1, trained.output[-2000:]
    for word in words:
        assert word in listed.output and word in said[0], (listed.output, said)
    assert no_traceback(trained.output)


# --- checkpoints pull -o: nothing of the user's replaced without --force, nothing written through a link ---

def test_pull_replaces_no_file_without_force_writes_through_no_link_and_refuses_the_root(finished_job, tmp_path):
    _, run = finished_job
    out = tmp_path / "mine"
    out.mkdir()
    (out / "pytorch_lora_weights.safetensors").write_text("the user's own file")
    pull = ("checkpoints", "pull", str(run), "--step", "final", "-o", str(out))
    result = kubetune(*pull)
    assert result.exit_code == 2 and "already holds pytorch_lora_weights.safetensors" in result.output, result.output
    assert "--force" in result.output
    assert (out / "pytorch_lora_weights.safetensors").read_text() == "the user's own file", "untouched"
    assert not list(out.glob(".kubetune-pull-*")), "no staging left behind"
    result = kubetune(*pull, "--force")
    assert result.exit_code == 0, result.output
    assert (out / "pytorch_lora_weights.safetensors").stat().st_size > 100, "replaced with --force"

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "target.pt").write_text("outside")
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "scheduler.pt").symlink_to(elsewhere / "target.pt")  # a file the checkpoint holds
    result = kubetune("checkpoints", "pull", str(run), "--step", "2", "-o", str(linked), "--force")
    assert result.exit_code == 2, result.output
    assert f"{linked / 'scheduler.pt'} is a symbolic link: kubetune never writes through one" in result.output
    assert (elsewhere / "target.pt").read_text() == "outside" and (linked / "scheduler.pt").is_symlink()

    result = kubetune("checkpoints", "pull", str(run), "-o", "/", "--force")
    assert result.exit_code == 2 and "-o / is the file system's root" in result.output, result.output


def test_a_folder_inside_the_pull_target_that_links_out_is_never_written_through(tmp_path):
    from kubetune_trainer.checkpoint.catalog import PullFailed, check_destinations

    elsewhere, target = tmp_path / "elsewhere", tmp_path / "target"
    elsewhere.mkdir()
    target.mkdir()
    (target / "unet").symlink_to(elsewhere)  # a full fine-tune's final weights go to unet/...
    for force in (False, True):
        with pytest.raises(PullFailed, match="unet is a symbolic link: kubetune never writes through one"):
            check_destinations(["unet/config.json", "unet/model.safetensors"], target, force)
    check_destinations(["unet2/config.json"], target, False)  # a real new folder is fine


# --- processes: no worker outlives its launcher, no silent server holds the end of a run --------

def process_gone(pid: int) -> bool:
    """Exited (or a zombie waiting for whoever adopted it to reap it): no longer training."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_kubetune_train_killed_with_sigkill_leaves_no_worker_training(tiny_job, tmp_path):
    import time

    from tests.trainer.test_distributed import descendants, kubetune_train

    launcher = kubetune_train(tiny_job(maxSteps=100_000, logEverySteps=1), tmp_path, 2,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for line in launcher.stderr:
        if "step 2/" in line:
            break
    workers = descendants(launcher.pid)
    assert len(workers) >= 2, "the launcher's two trainer processes"
    launcher.kill()  # SIGKILL: the launcher can pass nothing on
    launcher.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(process_gone(pid) for pid in workers):
        time.sleep(0.2)
    left = [pid for pid in workers if not process_gone(pid)]
    for pid in left:  # never leave them to the rest of the session
        os.kill(pid, signal.SIGKILL)
    assert not left, f"trainer processes {left} outlived their launcher"
    assert list(run_dir(tmp_path / "out").glob("checkpoint-*/manifest.json")), "they stopped as on SIGTERM: a checkpoint"


SILENT_SERVER_SCRIPT = """
import logging, socket, sys, time
logging.basicConfig(level=logging.INFO)
from kubetune_api.spec_resources import MlflowSpec
from kubetune_trainer.telemetry.tracking import MlflowTracker

listener = socket.create_server(("127.0.0.1", 0))
listener.listen(16)
held = []  # accepted connections are never answered (the kernel accepts them for us too)
port = listener.getsockname()[1]
tracker = MlflowTracker(MlflowSpec(uri=f"http://127.0.0.1:{port}", experiment="silent"), "run", {"a": "1"}, {})
tracker.log_metrics(1, {"train/loss": 0.5})
time.sleep(1)
started = time.monotonic()
tracker.close("FINISHED")
print(f"closed after {time.monotonic() - started:.1f} s", file=sys.stderr)
"""


def test_an_mlflow_server_that_accepts_and_never_answers_holds_the_end_of_a_run_seconds_only(tmp_path):
    import time

    from kubetune_trainer.telemetry.tracking import CLOSE_SECONDS_UNREACHABLE

    started = time.monotonic()
    result = subprocess.run([sys.executable, "-c", SILENT_SERVER_SCRIPT], env=trainer_env(), capture_output=True,
                            text=True, timeout=120)
    took = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-2000:]
    closed = float(result.stderr.split("closed after ")[1].split(" s")[0])
    assert CLOSE_SECONDS_UNREACHABLE <= closed < CLOSE_SECONDS_UNREACHABLE + 2, result.stderr[-2000:]
    # A warning: the tracker's own try is still waiting for the answer, so nothing else said the run is not logged.
    assert "WARNING:kubetune.trainer:MLflow: stopped waiting for http://127.0.0.1:" in result.stderr
    assert took < 60, f"the process ended {took:.0f} s after it started: the silent server held it"


# --- sweeps: search spaces counted, never built; a sweep's trials never resume another's runs ---

def billion_values_sweep(algorithm: str) -> dict:
    template = yaml_load(Path("manifests/examples/sd15-lora.yaml").read_text())
    return {"apiVersion": "kubetune.dev/v1alpha1", "kind": "TrainingSweep", "metadata": {"name": "huge"},
            "spec": {"algorithm": algorithm, "maxTrials": 4, "parallelTrials": 1,
                     "template": {"spec": template["spec"]}, "objective": {"metric": "loss"},
                     "parameters": {"training.seed": {"intRange": [0, 999_999_999]},
                                    "training.learningRate": {"floatRange": [1e-6, 1e-2], "step": 1e-11}}}}


def yaml_load(text: str):
    import yaml

    return yaml.safe_load(text)


def yaml_dump(document) -> str:
    import yaml

    return yaml.safe_dump(document)


def test_a_search_space_of_a_billion_values_is_counted_not_built(tmp_path):
    import time

    import yaml

    from kubetune_api.search import next_trial
    from kubetune_api.sweep import load_sweep

    path = tmp_path / "huge.yaml"
    path.write_text(yaml.safe_dump(billion_values_sweep("grid")))
    started = time.monotonic()
    result = kubetune("validate", "-f", str(path))
    assert result.exit_code == 2, result.output
    assert "spec.parameters: the grid has " in result.output and " points, more than 10000" in result.output, \
        result.output
    path.write_text(yaml.safe_dump(billion_values_sweep("random")))
    result = kubetune("validate", "-f", str(path))
    assert result.exit_code == 0, result.output
    sweep = load_sweep(path)
    drawn = [next_trial(sweep.spec, []).parameters["training.seed"] for _ in range(2)]
    assert 0 <= drawn[0] <= 999_999_999 and drawn[0] == drawn[1], "a draw, repeatable by its seed"
    assert time.monotonic() - started < 10, "counted and drawn from, never built (10^9 values would take minutes)"


def test_a_second_local_sweep_of_the_same_name_resumes_none_of_the_firsts_runs(tmp_path):
    """Two `kubetune sweep` of sweeps named alike train trial jobs of the same names (<sweep>-<n>):
    each sweep's trials carry its own identity in their run id, so the second gets new run versions
    where it used to continue (and overwrite) the first's finished runs; and the trial logs the first
    left in the workdir are not replaced without --force. (Both checked here without training: the
    whole path, two 2-step sweeps, takes about a minute.)"""
    from kubetune_api.sweep import load_sweep
    from kubetune_cli.sweep import LocalSweep
    from kubetune_trainer.checkpoint.runs import RunRecord, choose_version
    from tests.trainer.test_local_sweep import write_sweep

    path = write_sweep(tmp_path, tmp_path / "model", tmp_path / "data", "same", {"adapter.rank": {"choice": [2]}},
                       algorithm="grid", maxTrials=1, parallelTrials=1)
    first, second = (LocalSweep(load_sweep(path), tmp_path / "work") for _ in range(2))
    assert first.trial_run_id(0) != second.trial_run_id(0)
    assert first.trial_run_id(0) == first.trial_run_id(0) and first.trial_run_id(0).startswith("same-")
    finished = RunRecord(version=0, run_id=first.trial_run_id(0), steps=2, finished=True)
    assert choose_version([finished], first.trial_run_id(0)).continuing, "a trial restarted within its sweep resumes"
    chosen = choose_version([finished], second.trial_run_id(0))
    assert (chosen.version, chosen.continuing) == (1, False), "another sweep's trial gets a run of its own"

    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "same-0.log").write_text("the first sweep's trial log")
    result = kubetune("sweep", "-f", str(path), "--workdir", str(tmp_path / "work"))
    assert result.exit_code == 2, result.output
    assert "holds the trial logs of an earlier sweep 'same' (same-0.log, ...)" in result.output
    assert "--force" in result.output and "--workdir" in result.output
    assert (tmp_path / "work" / "same-0.log").read_text() == "the first sweep's trial log"


# --- images: every mode to RGB by one rule, bounded before decoding, only regular files ----------

def saved(image: Image.Image, path: Path, **options) -> Path:
    image.save(path, **options)
    return path


def grey16(path: Path) -> Path:
    """A 16-bit grey PNG at 32896/65535 (mid grey): Pillow's own RGB conversion clips it to white."""
    import numpy as np
    return saved(Image.fromarray(np.full((8, 8), 32896, dtype=np.uint16)), path.with_suffix(".png"))


def grey16_big_endian(path: Path) -> Path:
    import numpy as np
    return saved(Image.fromarray(np.full((8, 8), 16448, dtype=">u2")), path.with_suffix(".tif"))


def grey32(path: Path) -> Path:
    import numpy as np
    return saved(Image.fromarray(np.full((8, 8), 65535, dtype=np.int32)), path.with_suffix(".tif"))


def grey_float(path: Path) -> Path:
    import numpy as np
    return saved(Image.fromarray(np.full((8, 8), 0.25, dtype=np.float32)), path.with_suffix(".tif"))


def palette_with_transparency(path: Path) -> Path:
    image = Image.new("P", (8, 8), 0)
    image.putpalette([0, 0, 255] * 256)  # every entry blue, entry 0 transparent
    return saved(image, path.with_suffix(".png"), transparency=0)


def palette_of(colour: tuple[int, int, int]) -> Image.Image:
    image = Image.new("P", (8, 8), 0)
    image.putpalette(list(colour) * 256)
    return image


def turned_by_exif(path: Path) -> Path:
    """20x10 stored, left half red and right half blue, with EXIF orientation 6 (turn a quarter
    clockwise to view): viewed it is 10x20, red on top."""
    image = Image.new("RGB", (20, 10), (0, 0, 255))
    image.paste((255, 0, 0), (0, 0, 10, 10))
    exif = Image.Exif()
    exif[0x0112] = 6
    return saved(image, path.with_suffix(".png"), exif=exif.tobytes())


# (what, how to write it, the RGB the trainer reads at its centre: the stated rule)
IMAGE_MODES = [
    ("16-bit grey (I;16) is scaled, not clipped", grey16, (128, 128, 128)),
    ("16-bit big-endian grey (I;16B)", grey16_big_endian, (64, 64, 64)),
    ("32-bit grey (I) is read as 16-bit", grey32, (255, 255, 255)),
    ("float grey (F) is read as 0..1", grey_float, (64, 64, 64)),
    ("transparent RGBA is white", lambda p: saved(Image.new("RGBA", (8, 8), (255, 0, 0, 0)), p.with_suffix(".png")),
     (255, 255, 255)),
    ("half-transparent black over white", lambda p: saved(Image.new("RGBA", (8, 8), (0, 0, 0, 128)),
                                                          p.with_suffix(".png")), (127, 127, 127)),
    ("grey with alpha (LA)", lambda p: saved(Image.new("LA", (8, 8), (0, 255)), p.with_suffix(".png")), (0, 0, 0)),
    ("a palette with a transparent entry", palette_with_transparency, (255, 255, 255)),
    ("a palette image", lambda p: saved(palette_of((0, 200, 0)), p.with_suffix(".png")), (0, 200, 0)),
    ("CMYK (Pillow's formula, no ICC)", lambda p: saved(Image.new("CMYK", (8, 8), (0, 255, 0, 0)),
                                                        p.with_suffix(".tif")), (255, 0, 255)),
    ("1-bit", lambda p: saved(Image.new("1", (8, 8), 1), p.with_suffix(".png")), (255, 255, 255)),
]


@pytest.mark.parametrize("what,write,rgb", IMAGE_MODES, ids=[w for w, _, _ in IMAGE_MODES])
def test_every_image_mode_is_read_by_its_stated_rule(what, write, rgb, tmp_path):
    from kubetune_trainer.data.captions import CaptionedImage, CaptionsDataset
    from kubetune_trainer.data.images import ImageTransform
    from kubetune_trainer.data.screening import Screen

    path = write(tmp_path / "image")
    samples = Screen(skip_bad=False).images([CaptionedImage(path, "x")])  # screened as before training
    dataset = CaptionsDataset(samples, ImageTransform(8), caption_dropout=0.0, seed=0)  # the loader every layout shares
    pixels = dataset[0, 0]["pixel_values"]
    read = tuple(round(float(v)) for v in (pixels[:, 4, 4] + 1) * 127.5)
    assert all(abs(a - b) <= 1 for a, b in zip(read, rgb)), (what, read, rgb)


def test_exif_orientation_is_applied_to_the_pixels_and_to_the_size_buckets_read(tmp_path):
    from kubetune_trainer.data.captions import CaptionedImage, CaptionsDataset
    from kubetune_trainer.data.images import ImageTransform
    from kubetune_trainer.storage.stream import image_size

    path = turned_by_exif(tmp_path / "turned")
    assert image_size(path) == (10, 20), "buckets see the image as it is viewed: portrait"
    dataset = CaptionsDataset([CaptionedImage(path, "x")], ImageTransform((10, 20)), 0.0, seed=0)
    pixels = (dataset[0, 0]["pixel_values"] + 1) * 127.5
    assert pixels.shape[1:] == (20, 10)
    assert pixels[0, 2, 5] > 200 and pixels[2, 2, 5] < 50, "red on top"
    assert pixels[2, 17, 5] > 200 and pixels[0, 17, 5] < 50, "blue below"


def test_every_image_loader_reads_pixels_through_image_input():
    """One rule for every loader: no data module but data.image_input converts an image to RGB by itself."""
    sources = [p for p in Path("trainer_image/src/kubetune_trainer/data").glob("*.py") if p.name != "image_input.py"]
    offenders = [p.name for p in sources if '.convert("RGB")' in p.read_text() or "Image.open(" in p.read_text()]
    assert offenders == [] and len(sources) > 10


def header_only_png(path: Path, width: int, height: int) -> None:
    """A PNG whose header says width x height (what Image.open reads); its pixels are never reached."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\0\0" * 4)) + chunk(b"IEND", b""))


def fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def metadata_linked_outside(root: Path) -> None:
    outside = root.parent / "elsewhere.jsonl"
    (root / "metadata.jsonl").rename(outside)
    os.symlink(outside, root / "metadata.jsonl")


# (what, how the 12-sample captions set is spoiled, words the refusal must hold): read and screened
# in this process, as the trainer does before training (the trainer's exit 2 for these is the
# table above's ConfigError path, run once for the FIFO in test_a_fifo_among_the_images_...)
BAD_FILES = [
    ("a 1x20,000,000 strip", lambda root: header_only_png(root / "0001.png", 1, 20_000_000),
     ["0001.png", "1x20000000", "longer than 16 times its shorter side"]),
    ("an image over the pixel limit", lambda root: header_only_png(root / "0001.png", 10_000, 9_000),
     ["0001.png", "larger than 89478485 pixels"]),
    ("a FIFO among the images", lambda root: fifo(root / "0002.png"), ["0002.png", "FIFO", "not a regular file"]),
    ("a metadata.jsonl linked out of the data set", metadata_linked_outside,
     ["metadata.jsonl", "leads outside", "symbolic link"]),
    ("a caption holding a lone surrogate", lambda root: rewrite_line(root, 2, rb'{"file_name": "0001.png", '
                                                                           rb'"text": "a \ud800 b"}'),
     ["metadata.jsonl:2", "lone surrogate \\ud800"]),
    ("an image mode not converted (LAB)", lambda root: saved(Image.new("LAB", (32, 32)), root / "0003.tif")
     and rewrite_line(root, 4, b'{"file_name": "0003.tif", "text": "x"}'), ["0003.tif", "mode LAB"]),
]


@pytest.mark.parametrize("what,spoil,words", BAD_FILES, ids=[w for w, _, _ in BAD_FILES])
def test_a_hostile_file_is_refused_naming_it_before_anything_is_decoded(what, spoil, words, spoiled):
    from kubetune_trainer.data.captions import read_captions
    from kubetune_trainer.data.screening import Screen
    from kubetune_trainer.errors import ConfigError

    root = spoiled(spoil)
    signal.alarm(60)  # a FIFO opened for reading would block: fail instead of hanging
    try:
        with pytest.raises((ConfigError, FileNotFoundError)) as refused:
            Screen(skip_bad=False).images(read_captions(root, Screen(skip_bad=False)))
    finally:
        signal.alarm(0)
    message = str(refused.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_a_control_image_for_generate_is_bounded_from_its_header(tmp_path):
    from kubetune_trainer.results.generation import GenerationError, Request, check_request

    header_only_png(tmp_path / "strip.png", 1, 20_000_000)
    with pytest.raises(GenerationError, match=r"--control .*strip.png: is 1x20000000 pixels, longer than 16 times"):
        check_request("flux-kontext", Request(prompts=("make it blue",), controls=(tmp_path / "strip.png",)))


def test_fifos_in_an_edit_pairs_set_are_named_not_waited_on(tmp_path):
    """The layouts that list folders (edit pairs here; image folders read images the same way) meet a
    FIFO by its suffix: an instruction .txt and a control image, each named."""
    from kubetune_trainer.data.edit_pairs import read_edit_pairs
    from kubetune_trainer.data.screening import Screen

    data = write_tiny_data("edit-pairs", tmp_path / "pairs", count=6, size=32, seed=0)
    fifo(data / "training_images" / "0002.txt")
    fifo(data / "control_images" / "0004.jpg")
    screen = Screen(skip_bad=True)
    signal.alarm(60)  # opening a FIFO for reading would block: fail instead of hanging
    try:
        kept = screen.images(read_edit_pairs(data, screen))
    finally:
        signal.alarm(0)
    assert len(kept) == 4
    assert [problem.split(": ", 1)[1] for problem in screen.skipped] == [
        "is a FIFO (named pipe), not a regular file: only regular files are read from a data set"] * 2
    assert "0002.txt" in screen.skipped[0] and "0004.jpg" in screen.skipped[1]


def test_a_fifo_among_the_images_is_refused_by_the_trainer_not_waited_on(spoiled, tiny_sd15, tmp_path):
    manifest = family_job("sd15", "captions", tiny_sd15, spoiled(lambda root: fifo(root / "0002.png")),
                          tmp_path / "out")
    result = run_trainer_on(write_manifest(manifest, tmp_path), timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "0002.png is a FIFO (named pipe), not a regular file" in result.stderr, result.stderr[-3000:]
    assert no_traceback(result.stderr) and not (tmp_path / "out").exists()


# --- broken model folders: named by file and key, bounded before anything is built --------------

def config_copy(model: Path, tmp_path: Path) -> Path:
    """The tiny model's config files only (what kubetune plan reads)."""
    import shutil

    return Path(shutil.copytree(model, tmp_path / "model", ignore=shutil.ignore_patterns("*.safetensors", "*.bin")))


def set_key(file: Path, key: str, value) -> None:
    config = json.loads(file.read_text())
    config[key] = value
    file.write_text(json.dumps(config))


BROKEN_MODELS = [
    ("a config that is not JSON", lambda m: (m / "unet/config.json").write_text("{not json"),
     ["unet/config.json", "is not JSON"]),
    ("a config that is a list", lambda m: (m / "text_encoder/config.json").write_text("[1, 2]"),
     ["text_encoder/config.json", "holds a JSON list"]),
    ("a negative size", lambda m: set_key(m / "text_encoder/config.json", "hidden_size", -8),
     ["text_encoder/config.json", "hidden_size is -8", "at least 1"]),
    ("a zero size", lambda m: set_key(m / "unet/config.json", "in_channels", 0),
     ["unet/config.json", "in_channels is 0"]),
    ("an absurd layer count", lambda m: set_key(m / "text_encoder/config.json", "num_hidden_layers", 10**8),
     ["text_encoder/config.json", "num_hidden_layers is 100000000", "0 to 1024"]),
    ("a file instead of the folder", lambda m: None, ["spec.model.pretrained", "is a file, not a model folder"]),
]


def broken_model(what, breaks, tiny_sd15, tmp_path) -> Path:
    if what == "a file instead of the folder":
        (tmp_path / "model.json").write_text("{}")
        return tmp_path / "model.json"
    model = config_copy(tiny_sd15, tmp_path)
    breaks(model)
    return model


@pytest.mark.parametrize("what,breaks,words", BROKEN_MODELS, ids=[w for w, _, _ in BROKEN_MODELS])
def test_kubetune_plan_names_a_broken_model_folder_by_file_and_key(what, breaks, words, tiny_job, tiny_sd15, tmp_path):
    manifest = tiny_job()
    manifest["spec"]["model"]["pretrained"] = str(broken_model(what, breaks, tiny_sd15, tmp_path))
    result = kubetune("plan", "-f", str(write_manifest(manifest, tmp_path)))
    assert result.exit_code == 2, result.output
    for word in words:
        assert word in result.output, result.output
    assert isinstance(result.exception, SystemExit), result.exception


def test_the_trainer_names_a_broken_model_folder_before_loading_it(tiny_job, tiny_sd15, tmp_path):
    """The trainer (and `kubetune train`, which runs it) checks the folder with plan's function
    (model_folder): one case here, every case through plan above."""
    what, breaks, words = next(row for row in BROKEN_MODELS if row[0] == "an absurd layer count")
    manifest = tiny_job()
    manifest["spec"]["model"]["pretrained"] = str(broken_model(what, breaks, tiny_sd15, tmp_path))
    result = run_trainer_on(write_manifest(manifest, tmp_path), timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    for word in words:
        assert word in result.stderr, result.stderr[-3000:]
    assert no_traceback(result.stderr)
