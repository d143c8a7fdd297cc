"""Stopping and resuming long jobs (fairseq_softtopk.experiments.child_processes, run_lock, checkpoint_integrity,
and the runner behind fairseq-softtopk-ablation): signals to a real runner process end every fairseq child, start
no further run and leave the runs resumable to the exact update budget; a run directory is trained by one process
at a time; a finished checkpoint that changed on disk is refused."""

import hashlib
import json
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from conftest import REPO, clean_env, overwrite_tensor_bytes, run_fairseq
from fairseq_softtopk.cli import ablation as ablation_cli
from fairseq_softtopk.experiments import ablation_training, child_processes, run_lock
from fairseq_softtopk.experiments.checkpoint_integrity import CheckpointChanged, checkpoint_digest, verify_run_checkpoint

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's")

MAX_UPDATE = 60
#: one arm trained from scratch, a checkpoint every 4 updates, a log line every update
SCRATCH = f"""
description: tiny scratch ablation (stopping tests)
stage: scratch
baseline: tf
model: {{arch: softtopk_lstm_tiny}}
train: {{criterion: soft_beam_search, teacher-forcing-ratio: 1.0, optimizer: adam, lr: 0.005, batch-size: 16,
        max-update: {MAX_UPDATE}, save-interval-updates: 4, keep-interval-updates: 1, no-epoch-checkpoints: true,
        num-workers: 0, log-interval: 1}}
arms:
  tf: {{}}
eval: {{beam: 1, subsets: [test]}}
"""
WAIT = 300  # seconds to wait for a line of a runner (start-up is slow on a loaded machine)


def _stat(pid: int):
    """``(state, parent PID)`` of a process, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def children_of(pid: int):
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and (_stat(int(p)) or ("", 0))[1] == pid]


def running(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def still_running_after(pids, seconds: float):
    """The PIDs of ``pids`` still running after ``seconds`` (returns as soon as none is)."""
    deadline = time.monotonic() + seconds
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if running(pid)]


class Watched:
    """A command in its own process group (as a shell runs one), its output (stdout and stderr
    together) read as it comes."""

    def __init__(self, cmd):
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                                     env=clean_env(), start_new_session=True)
        self.lines, self.ended = [], False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def wait_for(self, pattern: str, start: int = 0) -> int:
        """The index of the first line from ``start`` on that matches ``pattern``."""
        deadline = time.monotonic() + WAIT
        with self._changed:
            while True:
                for i in range(start, len(self.lines)):
                    if re.search(pattern, self.lines[i]):
                        return i
                start = len(self.lines)
                if self.ended or time.monotonic() > deadline:
                    raise AssertionError(f"no line matching {pattern!r}:\n{self.output[-4000:]}")
                self._changed.wait(0.2)

    def child_running(self, module: str) -> int:
        """The PID of this command's child that runs ``python -m <module>``, once it runs."""
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline and self.proc.poll() is None:
            for pid in children_of(self.proc.pid):
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if module.encode() in f.read():
                        return pid
            time.sleep(0.05)
        raise AssertionError(f"no {module} child:\n{self.output[-4000:]}")

    def stop(self, signum: int, group: bool = False) -> dict:
        """Sends ``signum`` (to the process group: a terminal's Ctrl-C), waits for the end: the exit status,
        the seconds it took, and the children running before and after."""
        children = children_of(self.proc.pid)
        sent = time.monotonic()
        (os.killpg if group else os.kill)(self.proc.pid, signum)
        status = self.proc.wait(timeout=60)
        self._reader.join(10)
        return {"status": status, "seconds": time.monotonic() - sent, "children": children,
                "left": still_running_after(children, 5.0), "output": self.output}

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def stopped(toy_data_bin, tmp_path_factory):
    """One tiny scratch ablation (seeds 1 and 2, one after the other), stopped three times in seed 1: by SIGINT to
    its process group once fairseq-train saved its first checkpoint, by SIGKILL once the resumed run saved one, by
    SIGTERM once the rerun trained to the end and scores with fairseq-generate. Returns what each stop left."""
    root = tmp_path_factory.mktemp("stopping")
    (root / "scratch.yaml").write_text(SCRATCH)
    work = root / "work"
    cmd = [sys.executable, "-m", "fairseq_softtopk.cli.ablation", str(root / "scratch.yaml"),
           "--data-bin", str(toy_data_bin[1]), "--work-dir", str(work), "--seeds", "1", "2"]
    record = {"root": root, "work": work, "run": work / "seed1" / "tf", "cmd": cmd}
    runner = Watched(cmd)
    try:
        runner.wait_for(r"Saved checkpoint \S+seed1/tf/checkpoint_1_4\.pt")
        record["sigint"] = {**runner.stop(signal.SIGINT, group=True), "seed2": (work / "seed2").exists(),
                            "state": _status(cmd)}

        runner = Watched(cmd)
        runner.wait_for(r"Saved checkpoint", runner.wait_for(r"Loaded checkpoint \S+seed1/tf"))
        lock = record["run"] / "run.lock"
        state = _status(cmd)  # beside the live runner
        record["sigkill"] = {**runner.stop(signal.SIGKILL), "pid": runner.proc.pid,
                             "lock": json.loads(lock.read_text()) if lock.exists() else None, "state": state}

        runner = Watched(cmd)
        runner.wait_for(r"evaluating \S+seed1/tf on test")
        runner.child_running("fairseq_cli.generate")
        record["sigterm"] = {**runner.stop(signal.SIGTERM), "seed2": (work / "seed2").exists(),
                             "state": _status(cmd)}
    finally:
        runner.kill()
    return record


def _status(cmd) -> str:
    """What ``fairseq-softtopk-ablation ... --status`` prints for the runner command ``cmd``."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert ablation_cli.main([*cmd[3:], "--status"]) == 0
    return out.getvalue()


def _assert_stopped_cleanly(stop: dict, status: int):
    assert stop["status"] == status, stop["output"][-3000:]
    assert stop["children"] and not stop["left"], f"children {stop['children']}, still running: {stop['left']}"
    assert stop["seconds"] < 15
    assert "Traceback" not in stop["output"], stop["output"][-3000:]


def test_ctrl_c_ends_fairseq_train_starts_nothing_more_and_says_how_to_resume(stopped):
    stop = stopped["sigint"]
    _assert_stopped_cleanly(stop, 130)
    assert not stop["seed2"]  # the queued run did not start
    message = stop["output"][stop["output"].index("stopped by SIGINT"):]
    assert re.search(r"will resume: seed1/tf \(from update \d+\)", message) and "not started: seed2/tf" in message
    assert message.rstrip().splitlines()[-1].strip() == shlex.join(["fairseq-softtopk-ablation", *stopped["cmd"][3:]])


def test_sigkill_of_the_runner_kills_its_fairseq_process_and_leaves_a_lock_naming_both(stopped):
    stop = stopped["sigkill"]
    assert stop["status"] == -signal.SIGKILL
    assert stop["children"] and not stop["left"], f"orphans after SIGKILL: {stop['left']}"
    assert stop["lock"]["pid"] == stop["pid"] and stop["lock"]["child_pid"] == stop["children"][0]


def test_sigterm_ends_the_scoring_step_and_the_rerun_took_over_the_stale_lock(stopped):
    stop = stopped["sigterm"]
    _assert_stopped_cleanly(stop, 143)
    assert not stopped["sigterm"]["seed2"]
    assert f"taking over the lock of process {stopped['sigkill']['pid']} on " in stop["output"]
    assert "trained, scored on the rerun: seed1/tf" in stop["output"]
    assert not (stopped["run"] / "run.lock").exists()  # released on the way out


def test_the_resumed_run_kept_every_part_of_its_log_and_ended_at_the_exact_budget(stopped):
    run = stopped["run"]
    log = (run / "train.log").read_text()
    assert len(re.findall(r"\| fairseq_cli\.train \| \{", log)) == 3  # three fairseq-train starts, one log
    assert len(re.findall(r"Loaded checkpoint \S+ \(epoch \d+ @ \d+ updates\)", log)) == 2
    updates = [int(n) for n in re.findall(r"\| train_inner \| .*\bnum_updates=(\d+)", log)]
    assert max(updates) == MAX_UPDATE and log.count("done training in") == 1
    assert f"@ {MAX_UPDATE} updates" in re.findall(r"Saved checkpoint .*", log)[-1]
    done = json.loads((run / "done.json").read_text())
    assert done["checkpoint_sha256"] == checkpoint_digest(run / "checkpoint_last.pt")


@pytest.fixture(scope="module")
def straight(stopped):
    """The run of ``stopped`` trained again in another work directory, without a stop (with the same threads: their
    number changes the float arithmetic)."""
    work = stopped["root"] / "straight"
    cmd = [*stopped["cmd"][:6], "--work-dir", str(work), "--seeds", "1"]
    done = subprocess.run(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert done.returncode == 0, done.stdout[-3000:]
    return work / "seed1" / "tf"


def _losses_per_update(log: str) -> dict:
    """``{num_updates: loss}`` of a train log's train_inner lines, the last logged at each update."""
    return {int(n): loss for loss, n in re.findall(r"\| train_inner \| .*\bloss=([^,]+), .*\bnum_updates=(\d+)", log)}


def test_the_run_stopped_three_times_ends_with_the_weights_of_a_run_never_stopped(stopped, straight):
    """fairseq reseeds every update from the seed and the update number, and a mid-epoch save keeps the data
    iterator's place: the resumed run (stopped by SIGINT, SIGKILL and SIGTERM, dropout on) ends bit for bit
    where the straight run does, with the same losses logged."""
    import torch

    from fairseq_softtopk.checkpoint_safety import read_checkpoint

    resumed = read_checkpoint(stopped["run"] / "checkpoint_last.pt")["model"]
    once = read_checkpoint(straight / "checkpoint_last.pt")["model"]
    assert resumed.keys() == once.keys()
    assert all(torch.equal(resumed[name], once[name]) for name in once)
    losses = _losses_per_update((straight / "train.log").read_text())
    assert len(losses) == MAX_UPDATE and losses == _losses_per_update((stopped["run"] / "train.log").read_text())


def test_status_names_each_runs_state_beside_the_runner_and_after_each_stop(stopped):
    """``--status`` beside a live runner names its process and the run's last logged update and save; after a
    stop, what the rerun will do (as the stop message says)."""
    live = stopped["sigkill"]["state"].splitlines()
    pid = stopped["sigkill"]["pid"]
    assert re.fullmatch(rf"  seed1/tf  training \(process {pid} on \S+\): epoch 1, update \d+, last save at update "
                        r"\d+", live[1]), live
    assert live[2:] == ["  seed2/tf  not started", "0 of 2 runs finished"]
    after_sigint = stopped["sigint"]["state"].splitlines()
    resume_at = re.search(r"will resume: seed1/tf \(from update (\d+)\)", stopped["sigint"]["output"]).group(1)
    assert after_sigint[1] == f"  seed1/tf  stopped: resumes from update {resume_at} on the rerun"
    assert "  seed1/tf  trained, not scored (scored on the rerun)" in stopped["sigterm"]["state"].splitlines()


def _train_args(data_bin, save_dir, max_update: int = 24) -> list:
    """A hard beam-search run with dropout on, saved only at its end (by default within the first epoch of 25
    updates)."""
    return [str(data_bin), "--user-dir", str(REPO / "fairseq_softtopk"), "--cpu", "--arch", "softtopk_lstm_tiny",
            "--criterion", "soft_beam_search", "--teacher-forcing-ratio", "0.8", "--topk-mode", "hard",
            "--train-beam", "3", "--dropout", "0.2", "--optimizer", "adam", "--lr", "0.005", "--batch-size", "16",
            "--max-update", str(max_update), "--save-interval-updates", "1000", "--no-epoch-checkpoints", "--num-workers", "0",
            "--log-format", "simple", "--log-interval", "1", "--seed", "1", "--save-dir", str(save_dir)]


def test_sigusr1_saves_after_the_update_and_training_from_there_ends_as_a_run_never_signalled(toy_data_bin, tmp_path):
    """SIGUSR1 to fairseq-train (the plugin loaded): checkpoint_last.pt is written after the update in progress,
    without a score, and training goes on; the run that went on and the run killed right after the save and
    resumed from it both end with the weights, to the bit, of the run never signalled."""
    import torch

    from fairseq_softtopk.checkpoint_safety import read_checkpoint

    data_bin = toy_data_bin[1]
    run_fairseq("train", _train_args(data_bin, tmp_path / "straight"))
    logs = {}
    for name in ("went_on", "killed"):
        run = Watched([sys.executable, "-m", "fairseq_cli.train", *_train_args(data_bin, tmp_path / name)])
        try:
            asked = run.wait_for(r"\bnum_updates=9\b")
            os.kill(run.proc.pid, signal.SIGUSR1)
            saved = run.wait_for(r"Saved checkpoint", asked)
            if name == "killed":
                run.kill()
            else:
                assert run.proc.wait(timeout=WAIT) == 0, run.output[-3000:]
        finally:
            run.kill()
        logs[name] = run.output
        update = int(re.search(r"SIGUSR1: saving checkpoint_last\.pt at update (\d+), then training on",
                               run.output).group(1))
        assert update >= 9 and re.search(rf"Saved checkpoint \S+/{name}/checkpoint_last\.pt \(epoch 1 @ {update} "
                                          r"updates, score None\)", run.lines[saved])
    assert not (tmp_path / "killed" / "checkpoint_best.pt").exists()  # a save without validation
    resumed = run_fairseq("train", _train_args(data_bin, tmp_path / "killed"))
    assert f"(epoch 1 @ {update} updates)" in re.search(r"Loaded checkpoint .*", resumed.stdout + resumed.stderr)[0]
    straight = read_checkpoint(tmp_path / "straight" / "checkpoint_last.pt")["model"]
    for name in ("went_on", "killed"):
        weights = read_checkpoint(tmp_path / name / "checkpoint_last.pt")["model"]
        assert weights.keys() == straight.keys() and all(torch.equal(weights[k], straight[k]) for k in straight), name


def test_the_save_signal_is_installed_in_fairseq_train_only(monkeypatch):
    """Another program importing the plugin (here pytest, fairseq_cli.train imported) keeps its SIGUSR1."""
    import fairseq_cli.train

    from fairseq_softtopk import checkpoint_on_signal

    before = signal.getsignal(signal.SIGUSR1)
    assert checkpoint_on_signal.install() is False
    assert signal.getsignal(signal.SIGUSR1) == before
    assert not getattr(fairseq_cli.train.validate_and_save, "_saves_on_signal", False)


def test_a_run_resumed_at_and_after_an_epoch_end_ends_as_the_run_trained_in_one_go(toy_data_bin, tmp_path):
    """fairseq builds the training batches when its iterator is created, from the seed plus that epoch: a run
    resumed in epoch 2 got other batches than the run trained in one go (its weights differed by 0.07 here).
    With the plugin (resumed_batches) the run stopped at the end of epoch 1 (update 25) and in epoch 2 (update
    33) ends with the weights, to the bit, of the run trained in one go."""
    import torch

    from fairseq_softtopk.checkpoint_safety import read_checkpoint

    data_bin = toy_data_bin[1]
    run_fairseq("train", _train_args(data_bin, tmp_path / "one_go", max_update=40))
    loaded = []
    for max_update in (25, 33, 40):
        part = run_fairseq("train", _train_args(data_bin, tmp_path / "resumed", max_update=max_update))
        loaded += re.findall(r"Loaded checkpoint \S+ \((epoch \d+ @ \d+) updates\)", part.stdout + part.stderr)
    assert loaded == ["epoch 2 @ 25", "epoch 2 @ 33"]  # resumed at the start of epoch 2, then within it
    one_go = read_checkpoint(tmp_path / "one_go" / "checkpoint_last.pt")["model"]
    resumed = read_checkpoint(tmp_path / "resumed" / "checkpoint_last.pt")["model"]
    assert all(torch.equal(resumed[name], one_go[name]) for name in one_go)


def test_the_runner_passes_sigusr1_to_its_fairseq_train_children_only(caplog):
    """Within stop_on_signals, SIGUSR1 reaches the fairseq-train children (which save) and not the others
    (fairseq-generate would die of it), and the runner logs whom it asked."""
    listener = ("import signal, sys, time\n"
                "signal.signal(signal.SIGUSR1, lambda *a: (print('got SIGUSR1', flush=True), sys.exit(0)))\n"
                "print('ready', flush=True)\ntime.sleep(20)\n")
    before = signal.getsignal(signal.SIGUSR1)
    with caplog.at_level("INFO", logger="ablation"), child_processes.stop_on_signals():
        children = {tool: child_processes.start([sys.executable, "-c", listener, f"fairseq_cli.{tool}"],
                                                stdout=subprocess.PIPE, text=True) for tool in ("train", "generate")}
        try:
            assert all(proc.stdout.readline() == "ready\n" for proc in children.values())
            os.kill(os.getpid(), signal.SIGUSR1)
            assert children["train"].stdout.readline() == "got SIGUSR1\n"
            assert children["train"].wait(timeout=10) == 0 and children["generate"].poll() is None
        finally:
            for proc in children.values():
                proc.kill()
                proc.wait()
                proc.stdout.close()
                child_processes.forget(proc)
    assert f"SIGUSR1: asked fairseq-train ({children['train'].pid}) to save checkpoint_last.pt" in caplog.text
    assert signal.getsignal(signal.SIGUSR1) == before  # given back on leaving


def test_status_of_finished_unstarted_and_cut_short_runs(tmp_path, capsys):
    """A finished run's line carries its scores and chosen length penalty; a directory without a checkpoint starts
    again; the pretrained scoring and the report are named where they exist; a missing work dir is an error."""
    (tmp_path / "scratch.yaml").write_text(SCRATCH.replace("  tf: {}", "  tf: {}\n  soft: {topk-mode: soft}"))
    work = tmp_path / "work"
    argv = [str(tmp_path / "scratch.yaml"), "--work-dir", str(work), "--seeds", "1", "--arms", "tf", "soft",
            "--pretrained", "tf.pt", "--score-pretrained", "--status"]
    with pytest.raises(SystemExit) as exit_info:
        ablation_cli.main(argv)
    assert exit_info.value.code == 2 and "does not exist: nothing has run there yet" in capsys.readouterr().err
    (work / "seed1" / "tf").mkdir(parents=True)
    (work / "seed1" / "soft").mkdir()
    (work / "seed1" / "tf" / "done.json").write_text("{}")
    (work / "seed1" / "tf" / "eval.json").write_text(json.dumps(
        {"subsets": {"valid": {"bleu": 41.117, "lenpen": 1.4}, "test": {"bleu": 38.5, "lenpen": 1.4}}}))
    (work / "results.md").write_text("")
    assert ablation_cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:] == ["  pretrained checkpoint: not scored yet",
                         "  seed1/tf    finished: valid 41.12, test 38.50 BLEU (lenpen 1.4)",
                         "  seed1/soft  stopped before its first checkpoint: starts again on the rerun",
                         "1 of 2 runs finished", f"report: {work / 'results.md'}"]


def test_a_changed_finished_checkpoint_is_refused_before_scoring(stopped, capsys):
    """seed1/tf finished training and was stopped while scored: a flipped byte in its checkpoint stops the rerun
    before fairseq-generate, with both digests and the file named."""
    checkpoint = stopped["run"] / "checkpoint_last.pt"
    intact = checkpoint.read_bytes()
    flipped = bytearray(intact)
    flipped[len(flipped) // 2] ^= 0x01
    checkpoint.write_bytes(bytes(flipped))
    try:
        with pytest.raises(SystemExit) as exit_info:
            ablation_cli.main([*stopped["cmd"][3:-1]])  # --seeds 1
    finally:
        checkpoint.write_bytes(intact)
    message = capsys.readouterr().err
    assert exit_info.value.code == 1
    assert f"{checkpoint} changed after its run finished" in message
    assert checkpoint_digest(checkpoint) in message and hashlib.sha256(bytes(flipped)).hexdigest() in message
    assert not (stopped["run"] / "eval.json").exists() and not (stopped["run"] / "test.hyp").exists()


# ----------------------------------------------------------------------------- without fairseq processes

@pytest.fixture
def sleeper():
    """A live process that is not this one (the owner of a lock)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def _lock_of(pid: int, **fields) -> str:
    return json.dumps({"pid": pid, "pid_started": run_lock.process_start(pid), "host": socket.gethostname(),
                       "started": "2026-01-01 00:00:00", **fields})


def _inner_line(epoch: int, update: int) -> str:
    """A fairseq-train ``train_inner`` log line at ``update``."""
    return f"2026-01-01 00:00:00 | INFO | train_inner | epoch {epoch:03d}:  10 / 243 loss=2.1, num_updates={update}\n"


def _checkpoint_line(run: Path, verb: str, epoch: int, update: int, tail: str = "") -> str:
    """fairseq's ``Saved checkpoint`` (``verb="Saved"``) or ``Loaded checkpoint`` line of ``run``'s
    checkpoint_last.pt."""
    logger = {"Saved": "fairseq.checkpoint_utils", "Loaded": "fairseq.trainer"}[verb]
    return (f"2026-01-01 00:00:00 | INFO | {logger} | {verb} checkpoint {run}/checkpoint_last.pt "
            f"(epoch {epoch} @ {update} updates{tail})\n")


@pytest.fixture
def live_run(tmp_path, sleeper):
    """A run directory locked by a live process: (the directory, the start of its ``run_state`` line)."""
    run = tmp_path / "seed1" / "soft"
    run.mkdir(parents=True)
    (run / "run.lock").write_text(_lock_of(sleeper.pid))
    return run, f"training (process {sleeper.pid} on {socket.gethostname()}): "


def test_a_live_runs_status_is_its_last_save_until_it_logs_past_it(live_run):
    """A run resumed from a save made between two logged lines is at its save, not at the line before it, until
    its first line after the save."""
    from fairseq_softtopk.experiments.run_status import run_state

    run, live = live_run
    saved = _checkpoint_line(run, "Saved", 2, 523, ", score None")
    (run / "train.log").write_text(_inner_line(2, 510) + _inner_line(2, 520) + saved)
    assert run_state(run) == live + "epoch 2, update 523, last save at update 523"
    with (run / "train.log").open("a") as log:
        log.write(_inner_line(2, 530))
    assert run_state(run) == live + "epoch 2, update 530, last save at update 523"


def test_a_resumed_runs_status_forgets_the_lines_logged_past_its_save(live_run):
    """A process stopped at update 540 after its save at 523: the resumed run is at 523 (fairseq's ``Loaded
    checkpoint`` line), not at 540, until it logs again."""
    from fairseq_softtopk.experiments.run_status import run_state

    run, live = live_run
    saved = _checkpoint_line(run, "Saved", 2, 523, ", score None")
    (run / "train.log").write_text(_inner_line(2, 520) + saved + _inner_line(2, 530) + _inner_line(2, 540)
                                   + _checkpoint_line(run, "Loaded", 2, 523))
    assert run_state(run) == live + "epoch 2, update 523, last save at update 523"
    with (run / "train.log").open("a") as log:
        log.write(_inner_line(2, 530))
    assert run_state(run) == live + "epoch 2, update 530, last save at update 523"
    # a fine-tuning run that has loaded its pretrained model and logged nothing yet is starting
    (run / "train.log").write_text(_checkpoint_line(run, "Loaded", 23, 0))
    assert run_state(run) == live + "starting, no save yet"


def test_a_live_lock_refuses_the_run_naming_the_process_and_the_directory(tmp_path, sleeper, capsys):
    """A second runner on a run directory in use stops before it writes anything there (the CLI: one line)."""
    from test_ablation import _fake_data_bin

    data_bin, work = _fake_data_bin(tmp_path / "bin"), tmp_path / "work"
    run = work / "seed1" / "tf"
    run.mkdir(parents=True)
    (run / "run.lock").write_text(_lock_of(sleeper.pid))
    (tmp_path / "scratch.yaml").write_text(SCRATCH)
    with pytest.raises(SystemExit) as exit_info:
        ablation_cli.main([str(tmp_path / "scratch.yaml"), "--data-bin", str(data_bin), "--work-dir", str(work)])
    message = capsys.readouterr().err
    assert exit_info.value.code == 1 and f"{run} is in use by process {sleeper.pid} on " in message
    assert len(message.strip().splitlines()) == 1
    assert sorted(p.name for p in run.iterdir()) == ["run.lock"]  # nothing written, the lock kept
    # the owner's fairseq process alone (its runner gone) holds the directory as well
    (run / "run.lock").write_text(_lock_of(2 ** 22 + 1, child_pid=sleeper.pid))
    with pytest.raises(run_lock.RunDirectoryInUse, match=f"running fairseq process {sleeper.pid}"):
        with run_lock.run_lock(run):
            pass


def test_a_second_command_on_a_work_directory_in_use_is_refused_at_once(tmp_path, sleeper, capsys):
    """Two ablation runners on one work directory were both let in: each trained an arm, then both stopped on the
    other's run ("... is in use by process N"), with no report. The work directory itself is now locked from the
    start: a second runner (or main job) is refused at once in one line naming the process; nothing is written."""
    from fairseq_softtopk.cli import main_job
    from test_ablation import _fake_data_bin

    data_bin, work = _fake_data_bin(tmp_path / "bin"), tmp_path / "work"
    work.mkdir()
    (work / "run.lock").write_text(_lock_of(sleeper.pid))
    (tmp_path / "scratch.yaml").write_text(SCRATCH)
    with pytest.raises(SystemExit) as exit_info:
        ablation_cli.main([str(tmp_path / "scratch.yaml"), "--data-bin", str(data_bin), "--work-dir", str(work)])
    message = capsys.readouterr().err
    assert exit_info.value.code == 1 and len(message.strip().splitlines()) == 1
    assert f"{work} is in use by process {sleeper.pid} on " in message
    assert "two commands in one work directory would train and score the same runs" in message
    assert sorted(p.name for p in work.iterdir()) == ["run.lock"]  # nothing written, the lock kept
    # the main job too, before --fresh deletes anything (--arms nope: were it let in, it would stop soon after)
    with pytest.raises(SystemExit) as exit_info:
        main_job.main(["--work-dir", str(work), "--fresh", "--seeds", "1", "--sizes", "20", "5", "5", "--pretrain",
                       "--arms", "nope"])
    message = capsys.readouterr().err
    assert exit_info.value.code == 1 and f"{work} is in use by process {sleeper.pid} on " in message
    assert sorted(p.name for p in work.iterdir()) == ["run.lock"]


def test_the_work_directory_lock_of_a_dead_runner_is_taken_over_and_released(tmp_path, monkeypatch, caplog):
    """A runner killed outright leaves its work directory's lock: the next one takes it over (a log line), holds it
    while its runs train, and removes it when it ends."""
    from fairseq_softtopk.experiments import ablation_runner
    from fairseq_softtopk.experiments.ablation_config import load_config
    from test_ablation import _fake_data_bin

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    data_bin, work = _fake_data_bin(tmp_path / "bin"), tmp_path / "work"
    work.mkdir()
    (work / "run.lock").write_text(_lock_of(gone.pid))
    (tmp_path / "scratch.yaml").write_text(SCRATCH)
    holders = []

    def schedule(*args):  # instead of training: who holds the work directory meanwhile
        holders.append(json.loads((work / "run.lock").read_text())["pid"])
        raise ValueError("stopped before training")

    monkeypatch.setattr(ablation_runner, "_schedule", schedule)
    with caplog.at_level("WARNING", logger="ablation"), pytest.raises(ValueError, match="stopped before training"):
        ablation_runner.run_ablation(load_config(tmp_path / "scratch.yaml"), data_bin, work)
    assert holders == [os.getpid()] and f"taking over the lock of process {gone.pid} on " in caplog.text
    assert not (work / "run.lock").exists()


def test_a_stale_lock_is_taken_over_with_a_log_line_and_released(tmp_path, caplog):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (tmp_path / "run.lock").write_text(_lock_of(gone.pid))
    with caplog.at_level("WARNING", logger="ablation"):
        with run_lock.run_lock(tmp_path), run_lock.run_lock(tmp_path):  # nested: the same lock
            assert json.loads((tmp_path / "run.lock").read_text())["pid"] == os.getpid()
    assert f"taking over the lock of process {gone.pid} on " in caplog.text
    assert not (tmp_path / "run.lock").exists()


def _small_checkpoint(path: Path) -> bytes:
    """A whole torch checkpoint (zip archive) at ``path``; returns its bytes."""
    import torch

    torch.save({"model": {"w": torch.arange(4096.0)}}, path)
    return path.read_bytes()


def test_done_json_without_a_checksum_gets_one_keeping_its_time_then_a_change_is_refused(tmp_path, caplog):
    """A run finished before checksums were recorded: its digest is recorded at the first reuse (done.json keeps
    its modification time, which older eval.json caches are keyed on); a later change of the file is an error."""
    checkpoint = tmp_path / "checkpoint_last.pt"
    weights = _small_checkpoint(checkpoint)
    (tmp_path / "done.json").write_text(json.dumps({"args": [], "finished": "2026-01-01 00:00:00"}))
    os.utime(tmp_path / "done.json", ns=(10 ** 18, 10 ** 18))
    with caplog.at_level("INFO", logger="ablation"):
        assert verify_run_checkpoint(tmp_path) == checkpoint
    assert "recorded the SHA-256 of checkpoint_last.pt in done.json" in caplog.text
    done = json.loads((tmp_path / "done.json").read_text())
    assert done["checkpoint_sha256"] == hashlib.sha256(weights).hexdigest() and done["args"] == []
    assert (tmp_path / "done.json").stat().st_mtime_ns == 10 ** 18
    overwrite_tensor_bytes(checkpoint)
    with pytest.raises(CheckpointChanged, match=re.escape(done["checkpoint_sha256"])) as error:
        verify_run_checkpoint(tmp_path)
    assert str(checkpoint) in str(error.value) and checkpoint_digest(checkpoint) in str(error.value)


def test_done_json_without_a_checksum_does_not_record_the_digest_of_a_damaged_file(tmp_path):
    """The digest recorded at the first reuse vouches for the file from then on: a file whose tensor bytes changed
    (its zip CRC wrong; torch loads it) is refused then, not recorded."""
    checkpoint = tmp_path / "checkpoint_last.pt"
    _small_checkpoint(checkpoint)
    member = overwrite_tensor_bytes(checkpoint)
    (tmp_path / "done.json").write_text(json.dumps({"args": [], "finished": "2026-01-01 00:00:00"}))
    with pytest.raises(CheckpointChanged, match=rf"^{re.escape(str(checkpoint))} is not a whole checkpoint \(its member "
                       rf"{re.escape(member)} fails its CRC-32 check.* records no digest .* nothing was trained or "
                       r"scored with it$"):
        verify_run_checkpoint(tmp_path)
    assert "checkpoint_sha256" not in json.loads((tmp_path / "done.json").read_text())


def test_a_checkpoint_last_cut_short_is_named_before_fairseq_train_starts(tmp_path):
    """fairseq copies each checkpoint to checkpoint_last.pt: a stop during the copy leaves it truncated, and the
    error names the intact checkpoint to resume from."""
    run = tmp_path / "run"
    run.mkdir()
    with zipfile.ZipFile(run / "checkpoint_1_8.pt", "w") as archive:
        archive.writestr("archive/data.pkl", os.urandom(4000))
    (run / "checkpoint_last.pt").write_bytes((run / "checkpoint_1_8.pt").read_bytes()[:3000])
    flags = {"arch": "softtopk_lstm_tiny", "max-update": 8}
    with pytest.raises(RuntimeError, match=rf"{run / 'checkpoint_last.pt'} is cut short .* copy the newest intact "
                                           rf"checkpoint, {run / 'checkpoint_1_8.pt'}"):
        ablation_training.train_run(tmp_path / "bin", flags, run)
    assert "train.log" not in os.listdir(run)  # fairseq-train did not start


def test_a_checkpoint_last_whose_tensor_bytes_changed_is_named_before_fairseq_train_resumes(tmp_path):
    """Bytes overwritten inside a tensor of checkpoint_last.pt (same size, the zip's CRC-32 wrong): torch loads it,
    and the run resumed from it; now it is named, with the intact checkpoint to resume from, before fairseq-train
    starts."""
    run = tmp_path / "run"
    run.mkdir()
    _small_checkpoint(run / "checkpoint_1_8.pt")
    (run / "checkpoint_last.pt").write_bytes((run / "checkpoint_1_8.pt").read_bytes())
    member = overwrite_tensor_bytes(run / "checkpoint_last.pt")
    flags = {"arch": "softtopk_lstm_tiny", "max-update": 8}
    with pytest.raises(RuntimeError) as error:
        ablation_training.train_run(tmp_path / "bin", flags, run)
    assert str(error.value) == (
        f"{run / 'checkpoint_last.pt'} is not a whole checkpoint (its member {member} fails its CRC-32 check; "
        f"{(run / 'checkpoint_last.pt').stat().st_size:,} bytes; the bytes changed after they were written: damaged "
        f"on disk or in a copy?); nothing was trained: copy the newest intact checkpoint, {run / 'checkpoint_1_8.pt'}, "
        f"to {run / 'checkpoint_last.pt'} and rerun")
    assert "train.log" not in os.listdir(run)  # fairseq-train did not start


def test_a_run_resumed_with_another_thread_count_is_named(tmp_path, monkeypatch, caplog):
    """run.json records the fairseq process's OMP_NUM_THREADS; a resume with another count (which changes the
    float arithmetic) logs a warning naming both, a resume with the same count none."""
    from fairseq_softtopk.experiments.fairseq_commands import intra_op_threads

    def train(args, save_dir, verbose, record_child):  # fairseq-train's part: a checkpoint to resume from
        (save_dir / "checkpoint_last.pt").write_bytes(b"weights")

    monkeypatch.setattr(ablation_training, "_train", train)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    run, flags = tmp_path / "run", {"arch": "softtopk_lstm_tiny", "max-update": 8}
    with caplog.at_level("WARNING", logger="ablation"):
        for threads in (1, 1, 2, None):
            (run / "done.json").unlink(missing_ok=True)  # as a stop before the end leaves it
            with intra_op_threads(threads or 0):
                ablation_training.train_run(tmp_path / "bin", flags, run)
    assert json.loads((run / "run.json").read_text())["omp_num_threads"] == "1"
    assert [r.getMessage() for r in caplog.records] == [
        f"{run} resumes with OMP_NUM_THREADS={now} where it started with 1: the thread count changes the float "
        f"arithmetic, so from here on it is not the run an unstopped one would have been (--jobs sets the count "
        f"where OMP_NUM_THREADS is unset)" for now in ("2", "unset")]


def test_a_child_dies_with_the_thread_that_started_it(tmp_path):
    """PR_SET_PDEATHSIG is tied to the starting thread: a child lives while that thread waits for it (the
    runner's worker threads do, and other threads ending does not matter), and dies once the thread is gone."""
    started, release = queue.Queue(), threading.Event()

    def starter():
        started.put(child_processes.start([sys.executable, "-c", "import time; time.sleep(60)"]))
        release.wait()  # returns without waiting for the child: what no caller may do

    thread = threading.Thread(target=starter, daemon=True)
    thread.start()
    child = started.get(timeout=10)
    other = threading.Thread(target=lambda: None)
    other.start()
    other.join()
    try:
        assert still_running_after([child.pid], 0.3) == [child.pid]
        assert os.getsid(child.pid) == child.pid  # its own session: a terminal's Ctrl-C reaches the runner only
        release.set()
        thread.join()
        assert child.wait(timeout=5) == -signal.SIGKILL
    finally:
        child.kill()
        child_processes.forget(child)


def test_no_child_starts_once_a_stop_was_requested():
    with child_processes.stop_on_signals():
        with pytest.raises(child_processes.RunStopped) as stop:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises here
        assert stop.value.exit_status == 143
        with pytest.raises(child_processes.RunStopped):
            child_processes.run_captured([sys.executable, "-c", "print(1)"])
    assert child_processes.stopping() is None  # over on leaving: a later call runs again
    assert child_processes.run_captured([sys.executable, "-c", "print(1)"]).stdout == "1\n"


def test_sigterm_to_the_main_job_ends_its_fairseq_process_and_the_rerun_line_drops_fresh(tmp_path):
    """Stopped while it binarises its data: the rerun it prints must not repeat --fresh (which would discard what
    this call made)."""
    work = tmp_path / "main_job"
    args = ["--work-dir", str(work), "--sizes", "200", "20", "30", "--seeds", "1", "--pretrain"]
    job = Watched([sys.executable, "-m", "fairseq_softtopk.cli.main_job", *args, "--fresh"])
    try:
        job.child_running("fairseq_cli.preprocess")
        stop = job.stop(signal.SIGTERM)
    finally:
        job.kill()
    _assert_stopped_cleanly(stop, 143)
    assert stop["output"].rstrip().splitlines()[-1].strip() == shlex.join(["fairseq-softtopk-main-job", *args])
    assert json.loads((work / "main_job.json").read_text())["created"] == [
        "raw", "bin", "seed1", "pretrain", "results.json", "results.md", "curves.png", "agreement.md"]


def test_a_run_stopped_after_fairseq_train_ended_is_recorded_not_trained_again(tmp_path, caplog):
    """The runner killed between fairseq-train's end and done.json: resuming would train one update past the
    budget (fairseq steps once more before it checks max-update); the rerun records the run instead."""
    run = tmp_path / "run"
    run.mkdir()
    flags = {"arch": "softtopk_lstm_tiny", "max-update": 8}
    (run / "checkpoint_last.pt").write_bytes(b"the last checkpoint")
    (run / "train.log").write_text("| train_inner | epoch 001: 8 / 25 num_updates=8\n"
                                   "2026-01-01 00:00:00 | INFO | fairseq_cli.train | done training in 3.3 seconds\n\n")
    log = (run / "train.log").read_text()
    with caplog.at_level("INFO", logger="ablation"):
        done = ablation_training.train_run(tmp_path / "no_bin", flags, run, verbose=False)
    assert "fairseq-train had finished; recording it" in caplog.text and "training " not in caplog.text
    assert (run / "train.log").read_text() == log  # no fairseq-train ran
    assert done["checkpoint_sha256"] == hashlib.sha256(b"the last checkpoint").hexdigest()
    assert done["wall_seconds"] is None and json.loads((run / "done.json").read_text()) == done
