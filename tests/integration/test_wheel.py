"""The package as users install it: a wheel built with ``python -m build``
holds the library and the reader's weights, and nothing of the checkout's
benchmarks, training or test fixtures."""

from __future__ import annotations

import zipfile

import blend_integrations
from tests.fixtures.commands import ROOT, run_python


def test_the_wheel_holds_the_library_and_the_reader_weights_only(tmp_path):
    # sdist first, then the wheel from the unpacked sdist: what an index would serve
    run_python("-m", "build", "--no-isolation", "--outdir", str(tmp_path), str(ROOT), timeout=900)
    (wheel,) = tmp_path.glob("*.whl")
    assert wheel.name.startswith(f"blend_integrations-{blend_integrations.__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert top == {"blend_integrations", f"blend_integrations-{blend_integrations.__version__}.dist-info"}, top
    for needed in (
        "blend_integrations/__init__.py",
        "blend_integrations/py.typed",
        "blend_integrations/fusion/walk.py",
        "blend_integrations/engines/vllm_connector.py",
        "blend_integrations/quality/reader/model.safetensors",
        "blend_integrations/quality/reader/tokenizer.json",
        *(
            f"blend_integrations/data/calibrations/{m}-{e}.json"
            for m in ("reader", "smollm2", "gemma3-270m")
            for e in ("transformers", "vllm")
        ),
    ):
        assert needed in names, needed
    # benchmarks, training and fixtures stay in the checkout (the reader's training.json is its model card's data)
    modules = [n for n in names if n.endswith(".py")]
    assert not [n for n in modules if any(part in n for part in ("bench", "train", "local_models", "fixtures"))]
    entry_points = (
        zipfile.ZipFile(wheel)
        .read(f"blend_integrations-{blend_integrations.__version__}.dist-info/entry_points.txt")
        .decode()
    )
    assert "blend_integrations.engines.vllm_plugin:register" in entry_points
