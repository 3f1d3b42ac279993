"""One process of a real `jax.distributed` job that restores an msjax checkpoint onto other meshes.

Run by tests/jobs/test_checkpoint_sigterm.py, once per process; it writes what it saw (fingerprints,
gathered parameters, which shards it holds) under --out for the test to check, and asserts nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--local-devices", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--checkpoints", type=Path, required=True, help="RUN_DIR/checkpoints")
    parser.add_argument("--step", type=int, required=True)
    parser.add_argument(
        "--mesh", action="append", required=True, help="data,fsdp,tensor; repeat for several"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--save-to", type=Path, help="save the state restored onto the last mesh here (same step)"
    )
    return parser.parse_args()


def shard_report(tree: Any) -> dict[str, dict[str, Any]]:
    """Per array: its bytes, the bytes of the distinct shards this process holds, shard shapes."""
    import jax
    import numpy as np

    from msjax.checkpoint.fingerprint import leaf_name

    report = {}
    for path, array in jax.tree_util.tree_flatten_with_path(tree)[0]:
        itemsize = np.dtype(array.dtype).itemsize
        distinct = {str(shard.index): shard.data.size for shard in array.addressable_shards}
        expected_shape = array.sharding.shard_shape(array.shape)
        report[leaf_name(path)] = {
            "full_bytes": int(array.size) * itemsize,
            "local_bytes": sum(distinct.values()) * itemsize,
            "shard_shapes_match": all(
                shard.data.shape == expected_shape for shard in array.addressable_shards
            ),
            "spec": str(array.sharding.spec),
        }
    return report


def main() -> None:
    args = parse_args()
    import jax

    # before anything touches devices
    jax.config.update("jax_num_cpu_devices", args.local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=120,
    )

    import numpy as np
    from jax.experimental import multihost_utils

    from msjax.checkpoint.fingerprint import fingerprints, leaf_name
    from msjax.checkpoint.manager import Checkpointer
    from msjax.config import CheckpointConfig, config_from_dict
    from msjax.parallel.mesh import build_mesh
    from msjax.resolve import check_device_count
    from msjax.step import build_program

    reader = Checkpointer(args.checkpoints, CheckpointConfig(), read_only=True)
    meta = reader.metadata(args.step)
    saved_config = config_from_dict(meta["config"])
    seen: dict[str, Any] = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "meshes": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    restored = None
    config = saved_config
    for mesh_text in args.mesh:
        data, fsdp, tensor = (int(size) for size in mesh_text.split(","))
        config = dataclasses.replace(
            saved_config,
            mesh=dataclasses.replace(saved_config.mesh, data=data, fsdp=fsdp, tensor=tensor),
        )
        config = check_device_count(config, jax.device_count())
        mesh = build_mesh(config.mesh)
        program = build_program(config, mesh)
        restored = reader.restore(args.step, program.abstract_state())
        gathered = multihost_utils.process_allgather(restored.state.params, tiled=True)
        np.savez(
            args.out / f"params-{mesh_text}-process{args.process_id}.npz",
            **{
                leaf_name(path): np.asarray(value)
                for path, value in jax.tree_util.tree_flatten_with_path(gathered)[0]
            },
        )
        seen["meshes"][mesh_text] = {
            "restored_step": restored.step,
            "mesh_process_ids": np.vectorize(lambda d: d.process_index)(mesh.devices).tolist(),
            "fingerprints": fingerprints(restored.state),
            "arrays": shard_report(restored.state),
        }
    reader.close()

    if args.save_to is not None and restored is not None:
        writer = Checkpointer(args.save_to, config.checkpoint)
        kept = {key: meta[key] for key in ("data", "seed", "msjax_version")}
        writer.save(args.step, restored.state, {**kept, "config": config.to_dict()})
        writer.wait()
        writer.close()

    (args.out / f"process{args.process_id}.json").write_text(json.dumps(seen, indent=1))
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
