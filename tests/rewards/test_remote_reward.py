"""The ``remote`` reward against real servers on loopback: ``ff rewards serve`` subprocesses score exactly as the
local rewards do (images, videos, audio; batched over several requests; groupwise without splitting groups), and
every way a service fails (down, slow, malformed answers, HTTP errors, another medium) ends in one clear error,
within a bounded time. Last, one tiny SD3 GRPO iteration trains on remote rewards and logs what the local ones give."""

from __future__ import annotations

import csv
import json
import os
import pickle
import selectors
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from ff_core.errors import ConfigError
from ff_core.objectives.rewards import Rewards
from ff_core.rewards import GROUPWISE, Reward, RewardBatch
from ff_core.rewards.audio import AudioLoudnessReward
from ff_core.rewards.image import ColourReward
from ff_core.rewards.protocol import ProtocolError, decode_tensor, encode_tensor
from ff_core.rewards.remote import RemoteReward, RemoteRewardError
from ff_core.rewards.serve import RewardServer
from ff_core.rewards.serve import main as serve_main

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "configs" / "sd3" / "grpo_tiny.yaml"
SHAPES_REWARD = "ff_core.testing.shapes:PromptColourReward"
FAST = {"retries": 2, "backoff": 0.01}  # retries, but no waiting around in tests


# -- servers -------------------------------------------------------------------------------------------------------
def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as stderr:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip


def _url(proc: subprocess.Popen, log: Path, deadline: float) -> str:
    """The URL the server prints on its first line (``serving <name> on http://127.0.0.1:PORT``)."""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout=max(deadline - time.monotonic(), 0)):
            proc.kill()
            pytest.fail(f"the reward server printed no URL in time; its log: {log.read_text()[-2000:]}")
    line = proc.stdout.readline()
    assert line.startswith("serving ") and " on http://127.0.0.1:" in line, (line, log.read_text()[-2000:])
    return line.split()[-1]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Three real servers started side by side: ``ff rewards serve`` for colour (default args: closeness to green)
    and the shapes demo's prompt-colour reward (a dotted path), ``python -m ff_core.rewards.serve`` for audio
    loudness. Yields ``{name: (url, log file)}``."""
    logs = tmp_path_factory.mktemp("servers")
    ff = [sys.executable, "-m", "ff_core.cli", "rewards", "serve"]
    cmds = {
        "colour": [*ff, "--reward", "colour", "--port", "0"],
        "shapes": [*ff, "--reward", SHAPES_REWARD, "--args", "default: green"],
        "audio": [sys.executable, "-m", "ff_core.rewards.serve", "--reward", "audio_loudness", "--args",
                  '{"target_db": -20}', "--host", "127.0.0.1", "--device", "cpu"],
    }  # fmt: skip
    procs = {k: _start(cmd, logs / f"{k}.log") for k, cmd in cmds.items()}
    try:
        deadline = time.monotonic() + 60
        yield {k: (_url(p, logs / f"{k}.log", deadline), logs / f"{k}.log") for k, p in procs.items()}
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(timeout=10)
            p.stdout.close()


def _posts(log: Path) -> int:
    return log.read_text().count('"POST /score')


class FakeServer(ThreadingHTTPServer):
    """An in-test server answering ``/info`` as a colour server would and ``/score`` as ``answer`` says: a
    ``(status, body)`` pair, after ``delay`` seconds (cut short when the test ends). Counts the ``/score`` requests
    and keeps their headers."""

    daemon_threads = True

    def __init__(self, answer: tuple[int, str], delay: float = 0.0) -> None:
        super().__init__(("127.0.0.1", 0), _FakeHandler)
        self.answer, self.delay, self.posts, self.headers = answer, delay, 0, []
        self.done = threading.Event()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.done.set()
        self.shutdown()
        self.server_close()


class _FakeHandler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        self._send(200, json.dumps({"version": 1, "name": "colour", "kind": "pointwise", "media_types": ["image"],
                                    "required_fields": []}))  # fmt: skip

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.posts += 1
        self.server.headers.append(dict(self.headers))
        self.server.done.wait(self.server.delay)
        self._send(*self.server.answer)

    def _send(self, status, text):
        data = text.encode()
        try:
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client gave up (timeout) and closed the connection
            pass

    def log_message(self, *args):
        pass


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # nothing listens there any more: connections are refused


# -- batches -------------------------------------------------------------------------------------------------------
def images(n: int, size: int = 8, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (3, size, size), generator=g, dtype=torch.uint8) for _ in range(n)]


def image_batch(n: int = 5, groups: list[int] | None = None) -> RewardBatch:
    return RewardBatch([[x] for x in images(n)], [f"prompt {i}" for i in range(n)], [{"i": i} for i in range(n)],
                       None if groups is None else torch.tensor(groups))  # fmt: skip


def av_batch(n: int = 3) -> RewardBatch:
    """Samples of a video+audio adapter: uint8 (T, 3, H, W) videos at 8 fps, float32 (2, N) stereo at 16 kHz."""
    g = torch.Generator().manual_seed(1)
    media = [[torch.randint(0, 256, (4, 3, 8, 8), generator=g, dtype=torch.uint8),
              (torch.rand(2, 800, generator=g) * 2 - 1) * (0.1 + 0.3 * i)] for i in range(n)]  # fmt: skip
    return RewardBatch(media, ["p"] * n, [{}] * n, output_types=("video", "audio"), rates=(8.0, 16000.0))


# -- scores equal the local reward's ---------------------------------------------------------------------------
@pytest.mark.parametrize("encoding", ["raw", "png"])
def test_images_score_as_locally_over_several_requests(servers, encoding):
    url, log = servers["colour"]
    remote = RemoteReward(url, batch_size=2, encoding=encoding)
    assert (remote.kind, remote.media_types, remote.served) == ("pointwise", ("image", "video"), "colour")
    batch = image_batch(5)
    before = _posts(log)
    assert_close(remote(batch), ColourReward()(batch), rtol=0, atol=0)
    assert _posts(log) - before == 3  # 5 samples, 2 per request


def test_videos_and_audio_score_as_locally(servers):
    """Of a video+audio sample each server gets the medium its reward scores, with its rate."""
    batch = av_batch()
    assert_close(RemoteReward(servers["colour"][0])(batch), ColourReward()(batch), rtol=0, atol=0)
    audio = RemoteReward(servers["audio"][0], batch_size=2)
    assert audio.media_types == ("audio",)
    assert_close(audio(batch), AudioLoudnessReward(target_db=-20)(batch), rtol=0, atol=0)
    copied = pickle.loads(pickle.dumps(audio))  # EMA deep-copies the module, spawn pickles it
    assert_close(copied(batch), audio(batch), rtol=0, atol=0)


class GroupCentred(Reward):
    """Test reward: a sample's mean pixel minus its group's mean (groupwise); records the groups it was sent."""

    name = "group_centred"
    kind = GROUPWISE

    def __init__(self):
        super().__init__()
        self.seen: list[list[int]] = []

    def __call__(self, batch):
        x = torch.stack([m[0].float().mean() for m in batch.media])
        ids = batch.group_ids()
        self.seen.append(ids.tolist())
        return torch.stack([x[i] - x[ids == ids[i]].mean() for i in range(len(batch))])


def test_groupwise_requests_carry_whole_groups_and_their_ids():
    groups = [0, 1, 0, 2, 1, 0, 2, 2]  # sizes 3, 2, 3: interleaved, as gathered across ranks
    served = GroupCentred()
    with RewardServer(served, quiet=True) as server:
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        try:
            remote = RemoteReward(server.url, batch_size=4)
            assert remote.kind == GROUPWISE
            batch = image_batch(8, groups)
            assert_close(remote(batch), GroupCentred()(batch), rtol=0, atol=0)
            assert served.seen == [[0, 0, 0], [1, 1], [2, 2, 2]]  # no group split; 3 + 2 > 4 samples per request
            with pytest.raises(ValueError, match="kind: the reward server at .* serves 'group_centred', a groupwise"):
                RemoteReward(server.url, kind="pointwise")
        finally:
            server.shutdown()


class NeedsAnswer(Reward):
    name = "needs_answer"
    required_fields = ("answer",)

    def __call__(self, batch):
        return torch.tensor([float(m["answer"]) for m in batch.metadata])


def test_the_served_rewards_metadata_fields_are_checked_on_both_sides():
    """The client takes the served reward's fields from /info (so ``Rewards.check_records`` refuses a dataset
    lacking them before training); a request lacking them anyway is refused by the server, naming the sample."""
    with RewardServer(NeedsAnswer(), quiet=True) as server:
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        try:
            assert RemoteReward(server.url, required_fields=["id"]).required_fields == ("answer", "id")
            batch = RewardBatch([[x] for x in images(2)], ["a", "b"], [{"answer": 3}, {"answer": 4}])
            assert RemoteReward(server.url)(batch).tolist() == [3.0, 4.0]
            batch.metadata[1] = {}
            with pytest.raises(RemoteRewardError, match=r"HTTP 400: metadata\[1\]: reward 'needs_answer' needs the "
                                                        r"field 'answer' \(1 of 2 samples lack it\)"):  # fmt: skip
                RemoteReward(server.url, check_info=False)(batch)
        finally:
            server.shutdown()


# -- failures -------------------------------------------------------------------------------------------------------
def test_a_server_that_is_down_fails_quickly_naming_url_and_attempts():
    url = closed_port_url()
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"cannot use the reward server at {url}: remote reward {url}/info: "
                                         r"cannot connect \(.*refused.*\) \(attempt 3 of 3"):
        RemoteReward(url, **FAST)
    remote = RemoteReward(url, check_info=False, **FAST)  # no /info: the first batch meets the closed port
    with pytest.raises(RemoteRewardError, match=rf"{url}/score: cannot connect .*attempt 3 of 3"):
        remote(image_batch(2))
    assert time.monotonic() - start < 5


def test_a_slow_server_times_out_after_every_attempt_in_bounded_time():
    with FakeServer((200, '{"scores": [1.0, 1.0]}'), delay=30) as server:
        remote = RemoteReward(server.url, timeout=0.3, **FAST)
        start = time.monotonic()
        with pytest.raises(RemoteRewardError, match=r"/score: no answer within the 0.3 s timeout \(attempt 3 of 3"):
            remote(image_batch(2))
        assert time.monotonic() - start < 4  # 3 x 0.3 s plus the backoffs, with room for a busy machine
        assert server.posts == 3


@pytest.mark.parametrize(("answer", "message"), [
    ((200, "<html>busy</html>"), r"malformed answer: not JSON: '<html>busy</html>' \(attempt 1 of 3\)"),
    ((200, '{"scores": [0.5]}'), r"/score: malformed answer: the answer has 1 scores for 2 samples"),
    ((200, '{"scores": [NaN, 0.5]}'), r"/score: malformed answer: score 0 is nan, not a finite number"),
    ((200, '{"scores": [0.5, "high"]}'), r"score 1 is 'high', not a finite number"),
    ((200, '{"rewards": [0.5, 0.5]}'), r"the answer has no 'scores' list: \{'rewards'"),
    ((500, '{"error": "CUDA out of memory"}'), r"/score: HTTP 500: CUDA out of memory \(attempt 3 of 3"),
    ((400, '{"error": "metadata[0] lacks include"}'), r"HTTP 400: metadata\[0\] lacks include \(attempt 1 of 3; not "),
], ids=["not-json", "wrong-length", "nan", "not-a-number", "no-scores", "http-500", "http-400"])
def test_malformed_answers_and_http_errors_are_clear(answer, message):
    with FakeServer(answer) as server:
        with pytest.raises(RemoteRewardError, match=rf"remote reward {server.url}.*{message}"):
            RemoteReward(server.url, **FAST)(image_batch(2))
        assert server.posts == (3 if answer[0] == 500 else 1)  # only the 5xx is tried again


def test_the_servers_400_message_reaches_the_client(servers):
    """A client that sends what the served reward does not score (no /info to stop it) gets the reward's own
    message."""
    remote = RemoteReward(servers["colour"][0], check_info=False, media_types=["audio"], **FAST)
    with pytest.raises(RemoteRewardError, match=r"HTTP 400: reward 'colour' scores image/video but the samples hold "
                                                r"audio \(attempt 1 of 3; not retried\)"):  # fmt: skip
        remote(av_batch())


def test_info_mismatch_is_refused_before_training(servers):
    url = servers["audio"][0]
    rewards = Rewards([{"name": "remote", "args": {"url": url}}], config_key="model.objective.rewards")
    with pytest.raises(ConfigError, match=r"model.objective.rewards\[0\]: reward 'remote' scores audio, but sd3-5 "
                                          r"outputs image"):  # fmt: skip
        rewards.check_outputs(["image"], "sd3-5")
    with pytest.raises(ValueError, match=rf"media_types: the reward server at {url} serves 'audio_loudness', which "
                                         r"scores audio, not image"):  # fmt: skip
        RemoteReward(url, media_types=["image"])
    with pytest.raises(ConfigError, match=r"rewards\[0\].args: reward 'remote': reward: expected 'colour', but the "
                                          rf"reward server at {url} serves 'audio_loudness'"):  # fmt: skip
        Rewards([{"name": "remote", "args": {"url": url, "reward": "colour"}}])
    down = closed_port_url()
    with pytest.raises(ConfigError, match=rf"rewards\[0\].args: reward 'remote': cannot use the reward server at "
                                          rf"{down}: .*attempt 3 of 3"):  # fmt: skip
        Rewards([{"name": "remote", "args": {"url": down, **FAST}}])


@pytest.mark.parametrize(("args", "message"), [
    ({"url": "localhost:8123"}, "url must be http://host:port"),
    ({"retries": -1}, "retries must be an integer >= 0, got -1"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
    ({"timeout": 0}, "timeout must be a number of seconds > 0, got 0"),
    ({"encoding": "jpeg"}, "encoding must be one of raw, png, got 'jpeg'"),
    ({"media_types": ["text"]}, "media_types must be a non-empty list of image, video, audio"),
], ids=["url", "retries", "batch_size", "timeout", "encoding", "media_types"])
def test_options_are_checked_where_the_reward_is_built(args, message):
    with pytest.raises(ConfigError, match=rf"model.eval_rewards\[0\].args: reward 'remote': {message}"):
        Rewards([{"name": "remote", "args": {"url": "http://127.0.0.1:1", **args}}], config_key="model.eval_rewards")


def test_the_token_comes_from_the_environment_never_the_config(monkeypatch):
    with FakeServer((200, '{"scores": [1.0]}')) as server:
        with pytest.raises(ValueError, match="token_env: the environment variable 'FF_TEST_TOKEN' is not set"):
            RemoteReward(server.url, token_env="FF_TEST_TOKEN")
        with pytest.raises(ValueError, match="do not write a credential into the config"):
            RemoteReward(server.url, headers={"authorization": "Bearer x"})
        monkeypatch.setenv("FF_TEST_TOKEN", "s3cret")
        monkeypatch.setenv("http_proxy", closed_port_url())  # a proxy for the internet: loopback goes around it
        remote = RemoteReward(server.url, token_env="FF_TEST_TOKEN", headers={"X-Run": "7"})
        assert "s3cret" not in repr(remote) and "s3cret" not in repr(vars(remote))
        remote(image_batch(1))
        assert server.headers[-1]["Authorization"] == "Bearer s3cret" and server.headers[-1]["X-Run"] == "7"


# -- the protocol and the server's own checks ---------------------------------------------------------------------
@pytest.mark.parametrize("x", [torch.arange(24, dtype=torch.uint8).view(2, 3, 4), torch.randn(2, 5),
                               torch.randn(3, 2).to(torch.bfloat16), torch.zeros(0, 3), torch.tensor([True, False])])
def test_tensors_travel_exactly(x):
    assert torch.equal(decode_tensor(json.loads(json.dumps(encode_tensor(x))), "t"), x)


def test_png_is_lossless_and_a_short_payload_is_named():
    x = images(1, size=5)[0]
    item = encode_tensor(x, "png")
    assert item["encoding"] == "png" and torch.equal(decode_tensor(item, "t"), x)
    raw = encode_tensor(torch.zeros(2, 3))
    with pytest.raises(ProtocolError, match=r"media\[1\]\[0\].shape: expected a list"):
        decode_tensor({**raw, "shape": [2, -3]}, "media[1][0]")
    with pytest.raises(ProtocolError, match=r"media\[0\]\[0\].data: 24 bytes, but a float32 tensor of shape \[2, 4\]"):
        decode_tensor({**raw, "shape": [2, 4]}, "media[0][0]")


def test_ff_rewards_lists_and_serves(capsys):
    from ff_core.cli import main

    assert main(["rewards", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("remote  [ff-core ") for line in lines)
    assert any(line.startswith("colour  [ff-core ") and line.endswith("pointwise reward of image/video")
               for line in lines)
    assert main(["rewards"]) == 2 and capsys.readouterr().err.startswith("usage: ff rewards serve --reward NAME")
    assert main(["rewards", "srve"]) == 2 and "unknown subcommand 'srve'" in capsys.readouterr().err


def test_serve_refuses_an_unknown_reward_and_bad_args(capsys):
    assert serve_main(["--reward", "colr"], prog="ff rewards serve") == 2
    assert "ff rewards serve: --reward: unknown reward 'colr'; did you mean 'colour'?" in capsys.readouterr().err
    assert serve_main(["--reward", "colour", "--args", "[1, 2]"]) == 2
    assert "--args: expected a mapping of the reward's arguments, found [1, 2]" in capsys.readouterr().err
    assert serve_main(["--reward", "colour", "--args", "{measure: loudest}"]) == 2
    assert "--args: reward 'colour': measure must be" in capsys.readouterr().err


# -- training ---------------------------------------------------------------------------------------------------
def test_grpo_trains_on_remote_rewards_and_logs_what_the_local_ones_give(servers, tiny_sd3, tmp_path):
    """One GRPO iteration (2 prompts x 2 samples) whose trained reward is the shapes demo's prompt colour served
    remotely, besides (weight 0, logged only) the same reward computed locally, and colour both ways."""
    from ff_core.cli.flow_cli import FlowCLI
    from ff_core.data.datamodule import FlowDataModule
    from ff_core.module import FlowModule
    from ff_core.testing.shapes import write_prompt_dataset

    prompts = write_prompt_dataset(tmp_path / "prompts", colourless=False)
    rewards = [
        {"name": "remote", "weight": 1.0, "args": {"url": servers["shapes"][0], "timeout": 30}},
        {"name": SHAPES_REWARD, "weight": 0.0, "label": "local", "args": {"default": "green"}},
        {"name": "remote", "weight": 0.0, "label": "remote_colour", "args": {"url": servers["colour"][0]}},
        {"name": "colour", "weight": 0.0, "label": "local_colour"},
    ]
    cli = FlowCLI(FlowModule, FlowDataModule, run=False, args=[
        "--config", str(RECIPE), "--model.pretrained_model_name_or_path", str(tiny_sd3),
        "--model.objective.init_args.rewards", json.dumps(rewards), "--model.eval_rewards", "[]",
        "--model.objective.init_args.group_size", "2", "--model.objective.init_args.prompts_per_step", "2",
        "--model.objective.init_args.num_steps", "2", "--model.objective.init_args.micro_batch_size", "2",
        "--model.objective.init_args.sampler", json.dumps({"kind": "flow_sde", "eta": 0.7, "window": [0, 1]}),
        "--data.datasets", json.dumps([{"name": "prompts", "dataset_dir": str(prompts)}]),
        "--trainer.max_steps", "1", "--trainer.limit_val_batches", "0", "--trainer.callbacks", "[]",
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path),
        "--trainer.logger", json.dumps({"class_path": "lightning.pytorch.loggers.CSVLogger",
                                        "init_args": {"save_dir": str(tmp_path), "name": "logs", "version": 0}}),
    ])  # fmt: skip
    posts = _posts(servers["shapes"][1])
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.trainer.global_step == 1
    assert _posts(servers["shapes"][1]) == posts + 1  # 4 samples, one request
    [row] = [r for r in csv.DictReader(open(tmp_path / "logs" / "version_0" / "metrics.csv"))
             if r.get("train/reward_mean")]  # fmt: skip
    def logged(key):
        return torch.tensor([float(row[f"train/reward/{key}_{stat}"]) for stat in ("mean", "std")])

    assert_close(logged("remote"), logged("local"), rtol=0, atol=0)  # 0/1 scores: exactly
    # Colour is a mean over 3 x 32 x 32 pixels: float32 sums differ in the last bits between the decoded images'
    # memory layout in the trainer and the contiguous copy the server decodes, nothing more.
    assert_close(logged("remote_colour"), logged("local_colour"), rtol=1e-6, atol=1e-6)
    assert 0 < float(row["train/reward/remote_colour_mean"]) < 1
