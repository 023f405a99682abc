"""Bad LoRA input through the CLI (issue 17, acceptance 4): one clear message naming the file, exit 1, no
traceback. And the LyCORIS kinds: LoCon (kohya conv LoRA) applied, LoHa / LoKr / CP-LoCon refused by name."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from trt_diffusion.cli import main


def _refit(built_sd15, lora, capsys) -> tuple[int, str, str]:
    code = main(["refit", str(built_sd15), "--model", "sd15-tiny", "--lora", str(lora)])
    captured = capsys.readouterr()
    return code, " ".join(captured.out.split()), " ".join(captured.err.split())


def test_a_lora_for_another_family(built_sd15, tiny_model_factory, capsys):
    sdxl_lora = tiny_model_factory("sdxl", lora=True) / "lora/pytorch_lora_weights.safetensors"
    code, _, err = _refit(built_sd15, sdxl_lora, capsys)
    assert code == 1 and str(sdxl_lora) in err and "does not fit this unet" in err and "Traceback" not in err


def test_a_truncated_lora_file(built_sd15, tiny_sd15_dir, tmp_path, capsys):
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes((tiny_sd15_dir / "lora/pytorch_lora_weights.safetensors").read_bytes()[:200])
    code, _, err = _refit(built_sd15, cut, capsys)
    assert code == 1 and "cut.safetensors" in err and "cannot read LoRA file" in err and "Traceback" not in err


@pytest.mark.parametrize("kind,keys", [
    ("LoHa", {"lora_unet_down_blocks_1_attentions_0_proj_in.hada_w1_a": torch.ones(16, 2),
              "lora_unet_down_blocks_1_attentions_0_proj_in.hada_w1_b": torch.ones(2, 16)}),
    ("LoKr", {"lora_unet_down_blocks_1_attentions_0_proj_in.lokr_w1": torch.ones(4, 4),
              "lora_unet_down_blocks_1_attentions_0_proj_in.lokr_w2": torch.ones(4, 4)}),
    ("LoCon with a mid weight", {"lora_unet_down_blocks_0_resnets_0_conv1.lora_mid.weight": torch.ones(2, 2, 3, 3),
                                 "lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight": torch.ones(2, 8, 1, 1),
                                 "lora_unet_down_blocks_0_resnets_0_conv1.lora_up.weight": torch.ones(8, 2, 1, 1)}),
])
def test_unsupported_lycoris_kinds_are_refused_by_name(built_sd15, tmp_path, capsys, kind, keys):
    path = tmp_path / f"{kind.split()[0].lower()}.safetensors"
    save_file(keys, str(path))
    code, _, err = _refit(built_sd15, path, capsys)
    assert code == 1 and path.name in err and f"{kind}" in err and "not supported" in err and "Traceback" not in err


def test_a_locon_is_applied(built_sd15, capsys, tmp_path):
    """LoCon (LyCORIS) as kohya writes it: lora_down/lora_up on the resnets' 3x3 convolutions, with alpha."""
    torch.manual_seed(0)
    base = "lora_unet_down_blocks_0_resnets_0_conv1"
    keys = {f"{base}.lora_down.weight": torch.randn(2, 8, 3, 3) * 0.1,
            f"{base}.lora_up.weight": torch.randn(8, 2, 1, 1) * 0.1, f"{base}.alpha": torch.tensor(1.0),
            "lora_unet_down_blocks_1_attentions_0_proj_in.lora_down.weight": torch.randn(2, 16, 1, 1) * 0.1,
            "lora_unet_down_blocks_1_attentions_0_proj_in.lora_up.weight": torch.randn(16, 2, 1, 1) * 0.1}
    path = tmp_path / "locon.safetensors"
    save_file(keys, str(path))
    code, out, err = _refit(built_sd15, path, capsys)
    assert code == 0, err
    assert "sd15-tiny.unet.64x64.b2.fp32 │ 2 │" in out  # two weights replaced in the UNet engine
