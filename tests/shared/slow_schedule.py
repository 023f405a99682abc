"""How `make test-slow` hands test files to its two xdist workers (`--dist loadfile`, with this scheduler).

xdist's loadfile scheduling gives each worker whole files, the files with the most tests first. Two things that
costs on this suite, which it cannot know from test counts:

- Files that use the same session-built engines (`family_workspace`: every family's minimal entry, minutes, with
  the forms other files need — `built_qwen_image`, `built_z_image`, `built_wan`, FLUX.2 quantized — built over it;
  `built_wan_i2v`, `built_sd15_step_cache`: a minute or two of export and build each) land on both workers, and
  each worker builds them. Here they are one unit: built once. (The I2V serving file also serves a `built_wan`
  model: where the two units land on different workers, that worker builds it too.)
- The soak is one test of minutes. Counted as one test it is among the last units handed out, where it can run
  alone while the other worker idles. Here it starts first, and the other units of minutes follow it (RUN_FIRST).
  The family conformance run (tests/families/test_conformance.py: every family built, judged and served in one
  module, with the FLUX.2 file over the same build) is the longest unit and goes before it.
"""

from __future__ import annotations

# file -> the unit it joins: files that share a session fixture's build run on one worker
SHARED_BUILDS = {
    "tests/families/test_conformance.py": "family_workspace",
    "tests/parity/test_flux2_parity.py": "family_workspace",
    "tests/cli/test_generate_img2vid.py": "built_wan_i2v",
    "tests/export/test_wan_i2v_export.py": "built_wan_i2v",
    "tests/parity/test_wan_i2v_parity.py": "built_wan_i2v",
    "tests/preflight/test_video_i2v_preflight.py": "built_wan_i2v",
    "tests/triton/test_wan_i2v_serving.py": "built_wan_i2v",
    "tests/preflight/test_step_cache_preflight.py": "built_sd15_step_cache",
    "tests/parity/test_step_cache_parity.py": "built_sd15_step_cache",
    "tests/triton/test_step_cache_serving.py": "built_sd15_step_cache",
    "tests/preflight/test_video_preflight.py": "family_workspace",  # built_wan is built over family_workspace
    "tests/triton/test_video_serving.py": "family_workspace",
    "tests/triton/test_cfg_parallel_serving.py": "family_workspace",
    "tests/parity/test_wan_parity.py": "family_workspace",
    "tests/export/test_qwen_image_export.py": "family_workspace",  # built_qwen_image is built over family_workspace
    "tests/runtime/test_qwen_image_reference.py": "family_workspace",
    "tests/z_image/test_z_image_engines.py": "family_workspace",  # built_z_image is built over family_workspace
    "tests/z_image/test_z_image_lora.py": "family_workspace",
}
# the fixtures that build over a unit's shared fixture: a file of the unit uses one of them
BUILT_OVER = {"family_workspace": ("family_workspace", "built_families", "built_qwen_image", "built_z_image",
                                   "built_wan")}
# units of minutes that hold few tests, longest first (a file, or a SHARED_BUILDS unit): handed out before the
# rest, so the many short files fill both workers at the end instead of one long unit running alone there
RUN_FIRST = ("family_workspace", "tests/triton/test_soak.py", "built_wan_i2v",
             "tests/triton/test_qwen_image_edit_serving.py")


def make_scheduler(config, log):
    from xdist.scheduler import LoadFileScheduling

    class SharedBuildScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return SHARED_BUILDS.get(path, path)

        def _assign_work_unit(self, node) -> None:
            # xdist hands out the queue's first unit (the queue sorted by test count): a RUN_FIRST unit goes
            # to the front while it waits. The workers' collections, which xdist indexes, stay as collected.
            for unit in RUN_FIRST:
                if unit in self.workqueue:
                    self.workqueue.move_to_end(unit, last=False)
                    break
            super()._assign_work_unit(node)

    return SharedBuildScheduling(config, log)
