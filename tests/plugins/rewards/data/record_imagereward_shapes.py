"""Record the state-dict names and shapes of upstream's ``ImageReward`` module (what ``ImageReward.pt`` holds).

Not a test: run by hand, outside the project environment, to (re)create ``imagereward_v1_shapes.json``, which
``test_imagereward.py`` checks the port against. It builds the genuine upstream class from the ``image-reward``
wheel, so it needs a transformers 4.x that still has ``apply_chunking_to_forward`` in ``modeling_utils``
(recorded with transformers 4.46.3, tokenizers 0.20.3, huggingface_hub 0.26.5, timm 1.0.31, torch 2.14.1)::

    pip download image-reward==1.5 --no-deps -d /tmp/ir && unzip /tmp/ir/*.whl -d /tmp/ir/pkg
    pip install --target /tmp/tf4 --no-deps transformers==4.46.3 tokenizers==0.20.3 huggingface_hub==0.26.5
    git -C <THUDM/ImageReward clone> show c1392c6:train/src/config/med_config.json > /tmp/med_config.json
    PYTHONPATH=/tmp/tf4 python record_imagereward_shapes.py /tmp/ir/pkg /tmp/med_config.json imagereward_v1_shapes.json

Only what ``ImageReward.__init__`` never calls is replaced: OpenAI ``clip`` (imported by the package's other
scorers; not on PyPI), fairscale's ``checkpoint_wrapper`` (only used with gradient checkpointing) and BLIP's
``init_tokenizer`` (a hub download; the tokenizer holds no weights).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path


def main(pkg_dir: str, med_config: str, out: str) -> None:
    sys.path.insert(0, pkg_dir)
    sys.modules["clip"] = types.ModuleType("clip")
    wrapper = "fairscale.nn.checkpoint.checkpoint_activations"
    for name in ("fairscale", "fairscale.nn", "fairscale.nn.checkpoint", wrapper):
        sys.modules[name] = types.ModuleType(name)
    sys.modules[wrapper].checkpoint_wrapper = lambda m: m  # type: ignore[attr-defined]
    for name in ("ImageReward", "ImageReward.models"):  # skip the package __init__s (they import ReFL/diffusers)
        module = types.ModuleType(name)
        module.__path__ = [str(Path(pkg_dir, *name.split(".")))]
        sys.modules[name] = module

    import ImageReward.models.BLIP.blip_pretrain as blip_pretrain  # noqa: N813
    import transformers

    blip_pretrain.init_tokenizer = lambda: None  # type: ignore[attr-defined]
    from ImageReward.ImageReward import ImageReward  # type: ignore[import-not-found]

    model = ImageReward(med_config=med_config, device="cpu")
    shapes = {k: list(v.shape) for k, v in model.state_dict().items()}
    header = {
        "source": "THUDM/ImageReward ImageReward/ImageReward.py@c1392c6 (image-reward 1.5 wheel, same BLIP code)",
        "recorded_with": f"transformers {transformers.__version__}",
        "med_config": json.loads(Path(med_config).read_text()),
    }
    entries = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in shapes.items())  # one line per entry
    text = json.dumps(header, indent=1)[:-2] + ',\n "state_dict_shapes": {\n' + entries + "\n }\n}\n"
    assert json.loads(text)["state_dict_shapes"] == shapes
    Path(out).write_text(text)
    print(f"{len(shapes)} entries, {sum(_numel(s) for s in shapes.values())} numbers -> {out}")


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    main(*sys.argv[1:4])
