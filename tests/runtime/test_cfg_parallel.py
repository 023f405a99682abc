"""`cfg: parallel` (issue #24): split's two CFG calls of a step issued at once on two runner instances.

Fast, over the torch reference runners: engines.yaml expands `parallel` to exactly split's engines (same specs,
same keys; only the reason says parallel); the pipeline runs parallel only when it is declared; the two calls of
every step meet at a barrier (so they really run at the same time) on two different instances; the frames equal
split's bit for bit, for Wan 2.1, Wan 2.2's two experts and an image family (sd15: allowed, the same loop
plumbing); `at_once` never leaves a call running behind an error. The engines (onnxruntime, openvino) are in
test_cfg_parallel_engines.py (slow).
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import yaml

from trt_diffusion.engines_file import expand, load_engines_file
from trt_diffusion.errors import ConfigError
from trt_diffusion.runtime.cfg_parallel import at_once, cfg_instances
from trt_diffusion.runtime.engines import RunnerTable
from trt_diffusion.runtime.pipeline import EnginePipeline, GenerationRequest
from trt_diffusion.runtime.reference import reference_runners
from trt_diffusion.runtime.runners import CallableRunner

DENOISERS = ("unet", "transformer", "transformer_2")


def write(tmp_path, model_dir, family, **fields):
    model = {"source": str(model_dir), "family": family, "targets": ["onnxruntime"], **fields}
    path = tmp_path / "engines.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "models": {"m": model}}, sort_keys=False))
    return path


@pytest.mark.parametrize("family,bucket,split,parallel", [
    ("wan", "32x32x5", ["split"], ["parallel"]),
    ("wan", "32x32x5", ["batched", "split"], ["batched", "parallel"]),
    ("sd15", "64x64", ["batched", "split"], ["batched", "parallel"]),  # image families too: the same loop plumbing
])
def test_parallel_builds_exactly_the_engines_split_builds(tmp_path, tiny_model_factory, family, bucket, split,
                                                          parallel):
    folder = tiny_model_factory(family)
    specs = {}
    for name, cfg in (("split", split), ("parallel", parallel)):
        (tmp_path / name).mkdir()
        specs[name] = expand(load_engines_file(write(tmp_path / name, folder, family, buckets=[bucket], batch=[1, 2],
                                                     cfg=cfg)))
    assert [s.key for s in specs["parallel"]] == [s.key for s in specs["split"]]
    assert [s.key_fields() for s in specs["parallel"]] == [s.key_fields() for s in specs["split"]]
    reasons = [r for s in specs["parallel"] if s.component.is_denoiser and s.batch in (1, 2) for r in s.reasons]
    assert any("CFG parallel (split's engine, two instances at once)" in r for r in reasons)  # what `plan` shows


def test_an_unknown_cfg_mode_is_refused_at_its_line(tmp_path, tiny_model_factory):
    path = write(tmp_path, tiny_model_factory("wan"), "wan", buckets=["32x32x5"], cfg=["split", "paralel"])
    with pytest.raises(ConfigError, match=r"engines\.yaml:\d+: models\.m\.cfg\.1: 'paralel' is not one of "
                                          r".*'parallel'"):
        load_engines_file(path)


def test_only_the_calls_made_twice_a_step_get_a_second_instance():
    assert [cfg_instances(c, ["parallel"]) for c in (*DENOISERS, "controlnet", "text_encoder", "vae_decoder")] == [
        2, 2, 2, 2, 1, 1]
    assert cfg_instances("transformer", ["batched", "split"]) == cfg_instances("unet", ()) == 1
    with pytest.raises(ConfigError, match="unknown cfg mode.*choose from batched, split, parallel, none"):
        cfg_instances("unet", ["sideways"])


class Meeting:
    """Denoiser runners whose calls wait for each other in pairs: a call alone (not issued at once with another)
    breaks the barrier. Records which instance each call ran on."""

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=60)
        self.calls: list[int] = []
        self.lock = threading.Lock()

    def instance(self, runner, index: int):
        def run(feeds):
            with self.lock:
                self.calls.append(index)
            self.barrier.wait()
            return runner.run(feeds)

        return CallableRunner(run, runner.inputs, name=f"{runner.name} #{index}")


def tables(folder, family):
    """(split table: the reference runners; parallel table: their denoisers behind two meeting instances, Meeting)."""
    reference = reference_runners(folder, family)
    meeting, parallel = Meeting(), RunnerTable()
    for entry in reference.entries:
        if entry.component in DENOISERS:
            parallel.add(entry.component, meeting.instance(entry.runner, 0), bucket=entry.bucket, batch=entry.batch,
                         instances=(meeting.instance(entry.runner, 1),))
        else:
            parallel.add(entry.component, entry.runner, bucket=entry.bucket, batch=entry.batch)
    return reference, parallel, meeting


@pytest.mark.parametrize("variant,request_fields", [
    (None, dict(height=32, width=32, frames=5, guidance_scale=5.0, steps=3)),
    (None, dict(height=32, width=48, frames=9, guidance_scale=4.0, steps=2, batch=2)),  # two videos a prompt
    ("two_expert", dict(height=32, width=48, frames=5, guidance_scale=4.0, guidance_scale_2=2.5, steps=4)),
])
def test_wan_runs_both_halves_at_once_and_equals_split(tiny_model_factory, variant, request_fields):
    folder = tiny_model_factory("wan", variant=variant)
    reference, parallel_table, meeting = tables(folder, "wan")
    request = GenerationRequest("a red fox running through snow", seed=7, **request_fields)
    split = EnginePipeline(folder, "wan", reference).generate(request)
    parallel = EnginePipeline(folder, "wan", parallel_table, cfg=("parallel",)).generate(request)
    assert (split.cfg_mode, parallel.cfg_mode) == ("split", "parallel")
    np.testing.assert_array_equal(parallel.images, split.images)
    steps = request_fields["steps"]  # two experts: each step runs on one of them, both halves at once
    assert meeting.calls.count(0) == meeting.calls.count(1) == steps and not meeting.barrier.broken


def test_an_image_family_runs_parallel_as_split_bit_for_bit(tiny_model_factory):
    folder = tiny_model_factory("sd15")
    reference, parallel_table, meeting = tables(folder, "sd15")
    # the reference takes any batch, where the UNet loop prefers batched: a batch-1 UNet makes it split
    split_table = RunnerTable()
    for entry in reference.entries:
        split_table.add(entry.component, entry.runner, bucket=entry.bucket,
                        batch=1 if entry.component == "unet" else entry.batch)
    request = GenerationRequest("a lighthouse at dusk", 64, 64, steps=3, guidance_scale=7.5, seed=3)
    split = EnginePipeline(folder, "sd15", split_table).generate(request)
    parallel = EnginePipeline(folder, "sd15", parallel_table, cfg=("batched", "parallel")).generate(request)
    assert (split.cfg_mode, parallel.cfg_mode) == ("split", "parallel")  # declared parallel wins over batched
    np.testing.assert_array_equal(parallel.images, split.images)
    assert meeting.calls.count(0) == meeting.calls.count(1) == 3 and not meeting.barrier.broken


def test_parallel_is_never_guessed_and_needs_no_second_instance(tiny_model_factory):
    """Two instances in a table do not make a pipeline parallel (only its `cfg` does); a pipeline told parallel over
    one runner still issues both calls at once, to that runner (inside Triton: one BLS runner, two model
    instances behind it)."""
    folder = tiny_model_factory("wan")
    reference = reference_runners(folder, "wan")
    request = GenerationRequest("a fox", 32, 32, steps=2, guidance_scale=5.0, seed=1, frames=5)
    expected = EnginePipeline(folder, "wan", reference).generate(request).images
    two = RunnerTable()
    for entry in reference.entries:
        two.add(entry.component, entry.runner, bucket=entry.bucket, batch=entry.batch, instances=(entry.runner,))
    assert EnginePipeline(folder, "wan", two).generate(request).cfg_mode == "split"

    meeting, one = Meeting(), RunnerTable()
    for entry in reference.entries:
        runner = meeting.instance(entry.runner, 0) if entry.component == "transformer" else entry.runner
        one.add(entry.component, runner, bucket=entry.bucket, batch=entry.batch)
    generation = EnginePipeline(folder, "wan", one, cfg=["parallel"]).generate(request)
    assert generation.cfg_mode == "parallel" and meeting.calls == [0] * 4 and not meeting.barrier.broken
    np.testing.assert_array_equal(generation.images, expected)
    # without CFG there is no pair: one call a step, on the first instance
    meeting.calls.clear()
    meeting.barrier = threading.Barrier(1)
    no_cfg = GenerationRequest("a fox", 32, 32, steps=2, guidance_scale=1.0, seed=1, frames=5)
    assert EnginePipeline(folder, "wan", one, cfg=["parallel"]).generate(no_cfg).cfg_mode == "none"
    assert meeting.calls == [0, 0]


def test_at_once_runs_both_and_leaves_nothing_running_behind_an_error():
    barrier = threading.Barrier(2, timeout=10)
    assert at_once(lambda: barrier.wait() is not None and "a", lambda: barrier.wait() is not None and "b") == ("a", "b")
    finished = threading.Event()

    def slow():
        time.sleep(0.3)
        finished.set()
        return "late"

    def fails():
        raise ValueError("first half failed")

    with pytest.raises(ValueError, match="first half failed"):
        at_once(fails, slow)
    assert finished.is_set()  # the second half had finished before the error reached the caller
    with pytest.raises(KeyError):
        at_once(lambda: "fine", lambda: {}["missing"])


def test_a_forked_child_makes_workers_of_its_own():
    """A child forked after parallel steps ran (a build job, a test worker) runs its own: the parent's idle workers
    are not in it."""
    import os
    import signal

    assert at_once(lambda: 1, lambda: 2) == (1, 2)  # the parent's pool has a worker now
    pid = os.fork()
    if pid == 0:  # the child: killed by the alarm if the second half never runs
        signal.alarm(20)
        os._exit(0 if at_once(lambda: 3, lambda: 4) == (3, 4) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
