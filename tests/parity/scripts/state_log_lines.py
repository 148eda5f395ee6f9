# The save/load calls whose log lines kwplug mirrors (issue 28, item 6): `calls` is run by
# tests/parity/test_log_lines.py in-process under kwplug (records from caplog) and, with this
# file run as a script, under Accelerate in a subprocess (records written as JSON).
import json
import logging
import sys
from pathlib import Path


def calls(accelerator_class, project_configuration, root):
    """save_state, load_state, save_model and automatic naming with total_limit=1 (3 saves),
    each call after a line "=== <call>" at INFO on the root logger."""
    import torch

    marker = logging.getLogger("state_log_lines")
    root = Path(root)
    config = project_configuration(
        project_dir=str(root / "project"), automatic_checkpoint_naming=True, total_limit=1
    )
    accelerator = accelerator_class(cpu=True, project_config=config)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    counter = torch.nn.Linear(1, 1)  # a registered object: state_dict/load_state_dict
    accelerator.register_for_checkpointing(counter)
    for number in range(3):
        marker.info(f"=== save_state automatic {number}")
        accelerator.save_state()
    marker.info("=== load_state automatic")
    accelerator.load_state()
    marker.info("=== save_model")
    accelerator.save_model(model, str(root / "model"))
    marker.info("=== save_model sharded")
    accelerator.save_model(torch.nn.Linear(64, 64), str(root / "sharded"), max_shard_size="10KB")


def main():
    # Under Accelerate: every record at INFO and above, of Accelerate's loggers and the markers.
    import accelerate
    from accelerate.utils import ProjectConfiguration

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append([record.name, record.levelname, record.getMessage()])

    logging.getLogger().addHandler(Keep())
    logging.getLogger().setLevel(logging.INFO)
    calls(accelerate.Accelerator, ProjectConfiguration, sys.argv[1])
    Path(sys.argv[2]).write_text(json.dumps(records))


if __name__ == "__main__":
    main()
