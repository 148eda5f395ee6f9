# The checkpoint pattern of diffusers' training scripts (examples/unconditional_image_generation/
# train_unconditional.py and most others), reduced to a 4-8-4 MLP with diffusers'
# save_pretrained/from_pretrained layout: save/load pre-hooks that write the model with
# save_pretrained into `<output_dir>/unet` and pop its weights, `save_state` called under
# `if accelerator.is_main_process:`, resume with `load_state` then skipping the trained
# batches, either with `skip_first_batches` (Accelerate's idiom) or diffusers' own
# `if step < resume_step: continue`. Every accelerate import is renamed for kwplug's run
# (tests/parity/test_fidelity.py, issue 28); nothing else changes.
import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from safetensors.torch import load_file, save_file
from torch.utils.data import DataLoader, TensorDataset

WEIGHTS = "diffusion_pytorch_model.safetensors"


class TinyUNet(torch.nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.width = width
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 4)
        )

    def forward(self, x):
        return self.net(x)

    def save_pretrained(self, path):
        os.makedirs(path, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(state, os.path.join(path, WEIGHTS))
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"width": self.width}, f)

    @classmethod
    def from_pretrained(cls, path, subfolder=None):
        if subfolder:
            path = os.path.join(path, subfolder)
        with open(os.path.join(path, "config.json")) as f:
            model = cls(**json.load(f))
        model.load_state_dict(load_file(os.path.join(path, WEIGHTS)))
        return model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--checkpointing_steps", type=int, default=8)
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--resume_style", choices=["skip_first_batches", "continue"])
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--num_epochs", type=int, default=3)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)
    set_seed(0)
    model = TinyUNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.randn(24, 4)
    dataset = TensorDataset(torch.arange(24), data)
    train_dataloader = DataLoader(dataset, batch_size=2, shuffle=args.shuffle)

    def save_model_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            for i, model in enumerate(models):
                model.save_pretrained(os.path.join(output_dir, "unet"))
                # make sure to pop weight so that corresponding model is not saved again
                weights.pop()

    def load_model_hook(models, input_dir):
        for i in range(len(models)):
            # pop models so that they are not loaded again
            model = models.pop()
            load_model = TinyUNet.from_pretrained(input_dir, subfolder="unet")
            model.load_state_dict(load_model.state_dict())
            del load_model

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)

    model, optimizer, train_dataloader = accelerator.prepare(model, optimizer, train_dataloader)
    num_update_steps_per_epoch = len(train_dataloader)
    global_step = 0
    first_epoch = 0
    resume_step = 0
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        global_step = int(args.resume_from_checkpoint.rstrip("/").split("-")[-1])
        first_epoch = global_step // num_update_steps_per_epoch
        resume_step = global_step % num_update_steps_per_epoch

    trained, saved_files = [], {}
    for epoch in range(first_epoch, args.num_epochs):
        model.train()
        loader = train_dataloader
        resuming = args.resume_from_checkpoint and epoch == first_epoch
        if resuming and args.resume_style == "skip_first_batches":
            loader = accelerator.skip_first_batches(train_dataloader, resume_step)
        for step, (ids, clean) in enumerate(loader):
            # Skip steps until we reach the resumed step
            if resuming and args.resume_style == "continue" and step < resume_step:
                continue
            with accelerator.accumulate(model):
                noise = torch.randn(clean.shape)
                loss = torch.nn.functional.mse_loss(model(clean + noise), clean)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            trained.append(ids.tolist())
            if accelerator.sync_gradients:
                global_step += 1
                if global_step % args.checkpointing_steps == 0:  # noqa: SIM102 (diffusers' own)
                    if accelerator.is_main_process:
                        save_path = os.path.join(args.output_dir, f"checkpoint-{global_step}")
                        accelerator.save_state(save_path)
                        unet = os.path.join(save_path, "unet")
                        saved_files[global_step] = sorted(os.listdir(unet))
                        reloaded = TinyUNet.from_pretrained(save_path, subfolder="unet")
                        torch.save(reloaded.state_dict(), f"{args.record}.ckpt{global_step}.pt")

    accelerator.wait_for_everyone()
    rank = accelerator.process_index
    torch.save(accelerator.unwrap_model(model).state_dict(), f"{args.record}.rank{rank}.pt")
    with open(f"{args.record}.rank{rank}.json", "w") as f:
        json.dump({"trained": trained, "global_step": global_step, "files": saved_files}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
