"""The input pipeline: samples drawn ahead are the samples an unprefetched run draws (rule 1), in decoding
processes as in threads, a checkpoint holds the sampler as of the last step taken so a resume draws the same
sequence, decoding runs ahead with bounded memory, a failing or stuck decoder is a one-line error naming the
step, and JPEGs decode at reduced scale."""

from __future__ import annotations

import io
import multiprocessing
import os
import signal
import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from PIL import Image

from vip_core.data.shards import ShardWriter, encode_image
from vip_core.privacy.randomness import RandomStream
from vip_core.privacy.sampling import PoissonSampler
from vip_core.train.data import ShardPartition, decode_pixels, measure_shards
from vip_core.train import pipeline as pipeline_module
from vip_core.train.pipeline import DECODE_MODES, MIN_CHUNK, PROCESSES, THREADS, InputPipeline
from vip_core.train.step import PrivateStep


def sampler(entropy: int = 7) -> PoissonSampler:
    return PoissonSampler(200, 0.1, RandomStream(entropy, 0, "sampling"))


def fake_pixels(local: torch.Tensor) -> torch.Tensor:
    """Each index's image is filled with the index (mod 256): uint8 [k, 3, 2, 2]."""
    return (local % 256).to(torch.uint8).view(-1, 1, 1, 1).expand(-1, 3, 2, 2).clone()


def broken_pixels(local: torch.Tensor) -> torch.Tensor:
    raise OSError("shard web-000003.tar: connection reset\nsecond line of detail")


def endless_pixels(local: torch.Tensor) -> torch.Tensor:
    time.sleep(3600)
    return fake_pixels(local)


def decode_and_get_killed(rank: int, decoders: multiprocessing.SimpleQueue) -> None:
    """A spawned training process's work: decode a step in decoding processes, report their ids, die by SIGKILL."""
    pipeline = InputPipeline(sampler(), fake_pixels, mode=PROCESSES)
    pipeline.pixels(pipeline.sample())
    decoders.put([child.pid for child in multiprocessing.active_children()])
    os.kill(os.getpid(), signal.SIGKILL)


def exited(pid: int) -> bool:
    """Whether process ``pid`` is gone (a zombie left to a PID 1 that does not reap counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


LEFT_OPEN: list[InputPipeline] = []


def decode_and_leave_open(rank: int) -> None:
    """A spawned training process's work: decode a step in decoding processes and return without close(), one
    pipeline dropped and one still referenced when the process exits."""
    for pipeline in (InputPipeline(sampler(), fake_pixels, workers=1, mode=PROCESSES),
                     InputPipeline(sampler(), fake_pixels, workers=1, mode=PROCESSES)):
        local = pipeline.sample()
        assert torch.equal(pipeline.pixels(local), fake_pixels(local))
    LEFT_OPEN.append(pipeline)


@pytest.mark.parametrize("mode", DECODE_MODES)
def test_prefetched_samples_are_the_unprefetched_samples_in_order(mode, monkeypatch):
    monkeypatch.setattr(pipeline_module, "MIN_CHUNK", 1)  # every sample in 3 chunks, put back together in order
    plain = sampler()
    expected = [plain.sample() for _ in range(8)]
    pipeline = InputPipeline(sampler(), fake_pixels, ahead=2, workers=3, mode=mode)
    for want in expected:
        local = pipeline.sample()
        assert torch.equal(local, want)
        assert torch.equal(pipeline.pixels(local), fake_pixels(want))
    pipeline.close()


def test_decoding_processes_open_the_shards_of_a_partition_themselves(tmp_path):
    with ShardWriter(tmp_path / "shards", prefix="web", samples_per_shard=4) as writer:
        for index in range(10):
            writer.write(f"{index:06d}", {"jpg": encode_image(Image.new("RGB", (16, 16), (index * 20, 0, 0)), "jpg")})
    found = measure_shards((tmp_path / "shards").as_uri())  # file:// URLs, opened by each process
    partition = ShardPartition(found.shards, found.counts, 0, 1, 8)
    pipeline = InputPipeline(PoissonSampler(10, 0.5, RandomStream(3, 0, "sampling")), partition.decode,
                             mode=PROCESSES)
    for _ in range(3):
        local = pipeline.sample()
        decoded, expected = pipeline.pixels(local), partition.decode(local)
        assert torch.equal(decoded.pixels, expected.pixels) and torch.equal(decoded.usable, expected.usable)
    pipeline.close()


def test_a_spawned_training_process_with_decoding_processes_left_open_exits():
    # multiprocessing's exit of a spawned process joins its children before the executor would stop them:
    # a pipeline left open there once hung the two-process gloo test for good.
    children = mp.start_processes(decode_and_leave_open, nprocs=1, join=False, start_method="spawn")
    deadline = time.monotonic() + 60
    while not children.join(timeout=max(0.0, deadline - time.monotonic())) and time.monotonic() < deadline:
        pass
    stuck = [process for process in children.processes if process.is_alive()]
    for process in stuck:
        process.kill()
    assert not stuck, "the spawned process did not exit within 60 s of its work (its decoders were left open)"


def test_decoding_processes_end_when_their_training_process_is_killed():
    decoders = mp.get_context("spawn").SimpleQueue()
    children = mp.start_processes(decode_and_get_killed, args=(decoders,), nprocs=1, join=False,
                                  start_method="spawn")
    children.processes[0].join(60)
    pids = decoders.get() if not decoders.empty() else []
    deadline = time.monotonic() + 10
    while not all(exited(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if not exited(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert len(pids) == 2 and not left, f"decoding processes {left} outlived their killed training process"


def test_a_checkpoint_holds_the_sampler_of_the_last_step_taken_and_a_resume_draws_the_same_sequence():
    uninterrupted = InputPipeline(sampler(), fake_pixels, ahead=2, mode=THREADS)
    sequence = [uninterrupted.sample() for _ in range(7)]
    first = InputPipeline(sampler(), fake_pixels, ahead=2, mode=THREADS)
    for _ in range(3):
        first.sample()
    saved = first.state_dict()
    assert saved["steps_drawn"] == 3 and first.sampler.steps_drawn == 5  # two steps were drawn ahead
    resumed = InputPipeline(sampler(entropy=99), fake_pixels, ahead=2, mode=THREADS)
    resumed.load_state_dict(saved)
    assert all(torch.equal(resumed.sample(), want) for want in sequence[3:])
    for pipeline in (uninterrupted, first, resumed):
        pipeline.close()


def test_a_private_step_resumed_from_its_stream_state_continues_the_uninterrupted_samples(regression):
    plan = regression.plan(1e9, steps=8)

    def step() -> PrivateStep:
        built = regression.step(plan)
        built.prefetch(fake_pixels, ahead=2, mode=THREADS)
        return built

    original = step()
    drawn = [original.sampler.sample() for _ in range(2)]
    state = original.stream_state()
    continued = [original.sampler.sample() for _ in range(3)]
    resumed = step()
    resumed.sampler.load_state_dict(state["sampler"])
    assert len(drawn) == 2 and all(torch.equal(resumed.sampler.sample(), want) for want in continued)
    assert resumed.sampler.sample_rate == resumed.ledger.sample_rate == plan.sample_rate


def test_decoding_runs_ahead_in_threads_and_at_most_ahead_steps_wait():
    threads, loads, release = set(), [], threading.Event()

    def load(local: torch.Tensor) -> torch.Tensor:
        threads.add(threading.current_thread().name)
        loads.append(local)
        release.wait(5)
        return fake_pixels(local)

    pipeline = InputPipeline(sampler(), load, ahead=2, workers=2, mode=THREADS)
    local = pipeline.sample()
    assert pipeline.sampler.steps_drawn == 3  # the step taken and two ahead, no more
    release.set()
    pipeline.pixels(local)
    pipeline.sample()
    assert pipeline.sampler.steps_drawn == 4
    pipeline.close()
    assert threads and all(name.startswith("vip-input") for name in threads)


@pytest.mark.parametrize("mode", DECODE_MODES)
def test_an_empty_sample_gives_no_images(mode):
    pipeline = InputPipeline(PoissonSampler(10, 2.0**-40, RandomStream(1, 0, "sampling")), fake_pixels, mode=mode)
    local = pipeline.sample()
    assert len(local) == 0 and pipeline.pixels(local).shape == (0, 3, 2, 2)
    pipeline.close()


def test_a_failing_decoding_process_is_a_one_line_error_naming_the_step():
    pipeline = InputPipeline(sampler(), broken_pixels, mode=PROCESSES)
    local = pipeline.sample()
    with pytest.raises(RuntimeError) as caught:
        pipeline.pixels(local)
    assert str(caught.value) == ("decoding the sample of step 1 failed in the processes: "
                                 "OSError: shard web-000003.tar: connection reset")
    pipeline.close()


def test_a_decoder_that_does_not_answer_is_a_timeout_naming_the_step():
    release = threading.Event()

    def stuck(local: torch.Tensor) -> torch.Tensor:
        release.wait(5)
        return fake_pixels(local)

    pipeline = InputPipeline(sampler(), stuck, mode=THREADS, timeout=0.2)
    local = pipeline.sample()
    started = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"^decoding the sample of step 1 took longer than 0.2 s \(2 threads\)$"):
        pipeline.pixels(local)
    assert time.perf_counter() - started < 2
    release.set()
    pipeline.close()


def test_closing_kills_decoding_processes_that_do_not_stop_within_the_timeout(caplog):
    before = set(multiprocessing.active_children())
    pipeline = InputPipeline(sampler(), endless_pixels, workers=2, mode=PROCESSES, timeout=1.0)
    pipeline.sample()
    started = time.perf_counter()
    pipeline.close()
    assert time.perf_counter() - started < 10
    assert not [child for child in multiprocessing.active_children() if child not in before]
    assert "2 decoding processes still running 1 s after the input pipeline closed were killed" in caplog.text


def test_closing_gives_the_decoders_a_short_grace_not_the_decode_timeout(caplog, monkeypatch):
    monkeypatch.setattr(pipeline_module, "STOP_GRACE_S", 1.0)  # a hung decoder's run then fails in 1 s, not 600
    pipeline = InputPipeline(sampler(), endless_pixels, workers=2, mode=PROCESSES)  # the default 600 s timeout
    pipeline.sample()
    started = time.perf_counter()
    pipeline.close()
    assert time.perf_counter() - started < 10
    assert "still running 1 s after the input pipeline closed were killed" in caplog.text


def test_an_unknown_decode_mode_is_refused():
    with pytest.raises(ValueError, match="decode mode must be one of processes, threads, got 'fork'"):
        InputPipeline(sampler(), fake_pixels, mode="fork")


def test_pixels_of_another_sample_is_a_clear_error():
    pipeline = InputPipeline(sampler(), fake_pixels, mode=THREADS)
    pipeline.sample()
    with pytest.raises(ValueError, match="other than the last one"):
        pipeline.pixels(torch.arange(3))
    pipeline.close()


def test_a_jpeg_decodes_at_reduced_scale_close_to_the_full_decode():
    rows = np.linspace(0, 255, 256, dtype=np.float32)
    smooth = np.stack([np.add.outer(rows, rows) / 2, np.add.outer(rows, 255 - rows) / 2,
                       np.full((256, 256), 128.0)], -1).astype(np.uint8)  # [256, 256, 3]
    payload = encode_image(Image.fromarray(smooth), "jpg")
    pixels = decode_pixels(payload, 64)
    with Image.open(io.BytesIO(payload)) as image:
        full = np.asarray(image.convert("RGB").resize((64, 64), Image.BICUBIC))  # [64, 64, 3]
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, 64, 64)
    assert np.abs(pixels.permute(1, 2, 0).numpy().astype(int) - full.astype(int)).mean() < 3.0


@pytest.mark.parametrize(("size", "workers", "chunks"), [
    (0, 2, [0]), (MIN_CHUNK, 2, [MIN_CHUNK]), (2 * MIN_CHUNK - 1, 2, [2 * MIN_CHUNK - 1]),
    (2 * MIN_CHUNK, 2, [MIN_CHUNK, MIN_CHUNK]), (2 * MIN_CHUNK + 1, 3, [MIN_CHUNK + 1, MIN_CHUNK]),
    (6 * MIN_CHUNK + 3, 3, [2 * MIN_CHUNK + 1] * 3),
])
def test_a_sample_is_decoded_in_balanced_jobs_of_at_least_min_chunk_images_at_most_one_per_worker(
        size, workers, chunks):
    calls: list[list[int]] = []

    def counted(local: torch.Tensor) -> torch.Tensor:
        calls.append(local.tolist())
        return fake_pixels(local)

    every_image = PoissonSampler(size, 1.0, RandomStream(3, 0, "sampling")) if size else (
        PoissonSampler(1, 2.0**-64, RandomStream(3, 0, "sampling")))  # q = 2^-64: an empty sample
    pipeline = InputPipeline(every_image, counted, ahead=1, workers=workers, mode=THREADS)
    local = pipeline.sample()
    assert torch.equal(pipeline.pixels(local), fake_pixels(local))  # in order
    pipeline.close()
    assert len(local) == size
    sizes, expected = Counter(len(job) for job in calls), Counter(chunks)
    assert sizes & expected == expected  # the step taken; the step drawn ahead (the same sample at q = 1) may
    assert sizes - expected <= expected  # have been decoded too, or part of it, before close() cancelled it

