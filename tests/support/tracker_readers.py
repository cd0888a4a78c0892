"""Read back what the trackers wrote, with each library's own reader: TensorBoard's event accumulator, MLflow's
client, and W&B's own record type (wandb.proto's Record) for an offline run's transaction log."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})  # 0: keep every event
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def tensorboard_hparams(log_dir: Path) -> dict[str, Any]:
    """The HParams plugin's session start info: the config the run was given."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    from tensorboard.plugins.hparams import plugin_data_pb2

    mux = EventMultiplexer({"run": str(log_dir)})
    mux.Reload()
    content = mux.PluginRunToTagToContent("hparams")["run"]
    data = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in data.session_start_info.hparams.items()}


def wandb_records(run_dir: Path) -> dict[str, Any]:
    """The latest offline run under run_dir/wandb (a resumed run writes a folder of its own)."""
    return wandb_records_of(sorted((run_dir / "wandb").glob("offline-run-*"))[-1])


def wandb_records_of(folder: Path) -> dict[str, Any]:
    """history (step -> {key: value}), config and summary of an offline run's folder. The file
    is W&B's transaction log: a 7-byte header (':W&B', 0xBEE1, version), then LevelDB-log framing (32 KiB
    blocks; records of crc32, length, type; FULL=1, FIRST=2, MIDDLE=3, LAST=4) around protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    [path] = folder.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, chunks, out = 32768, 7, [], {"history": {}, "config": {}, "summary": {}}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a whole record
            record = wandb_internal_pb2.Record.FromString(b"".join(chunks))
            chunks = []
            which = record.WhichOneof("record_type")
            if which == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                out["history"][int(items.pop("_step"))] = items
            elif which in ("config", "run"):  # the config comes with the run record, updates on their own
                config = record.config if which == "config" else record.run.config
                out["config"].update({item.key: json.loads(item.value_json) for item in config.update})
            elif which == "summary":
                out["summary"].update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                       for item in record.summary.update})
    return out


def mlflow_run(tracking_uri: str, run_id: str) -> dict[str, Any]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    run = client.get_run(run_id)
    metrics = {key: {m.step: m.value for m in client.get_metric_history(run_id, key)} for key in run.data.metrics}
    return {"status": run.info.status, "params": run.data.params, "tags": run.data.tags, "metrics": metrics,
            "histories": {key: client.get_metric_history(run_id, key) for key in run.data.metrics}}
