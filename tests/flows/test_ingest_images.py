"""``make ingest INPUT=FOLDER``: the ingestion flow reads a folder of images instead of a url list, through the make
driver's ``run_target``; the same folder again is Cached, a folder with a photo added is ingested anew."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from flows.app.run import run_target, stage_states
from vip_core.config import tiny

ROOT = Path(__file__).resolve().parents[2]


def test_the_makefile_passes_input_to_the_flow():
    commands = subprocess.run(["make", "-n", "ingest", "PRESET=tiny", "INPUT=s3://bucket/photos"], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout
    assert "-m flows.app.run ingest --preset tiny --input s3://bucket/photos" in " ".join(commands.split())


def test_make_ingest_reads_an_input_folder_and_ingests_a_changed_one_anew(prefect_api, own_images, tmp_path):
    options = dict(eval_data=str(own_images["eval_data"]), workdir=str(tmp_path / "runs"))
    first = run_target("ingest", tiny(), image_folder=str(own_images["folder"]), **options)
    again = run_target("ingest", tiny(), image_folder=str(own_images["folder"]), **options)
    changed = tmp_path / "photos"
    shutil.copytree(own_images["folder"], changed, symlinks=True)
    shutil.copy(changed / "2023" / "IMG_0002.jpg", changed / "2023" / "IMG_0002 (2).jpg")
    grown = run_target("ingest", tiny(), image_folder=str(changed), **options)

    stats = {key: value for key, value in first.result().items() if key not in ("output", "shards")}
    assert stats == own_images["stats"]
    assert [state for _, state in stage_states(first)] == ["Completed"]
    assert [state for _, state in stage_states(again)] == ["Cached"]
    assert [state for _, state in stage_states(grown)] == ["Completed"]
    assert (grown.result()["input"], grown.result()["duplicates"]) == (14, 3)
    assert grown.result()["output"] != first.result()["output"] == again.result()["output"]
    assert Path(first.result()["output"]).parent == tmp_path / "runs"
