"""Data-parallel training with the soft_beam_search criterion (torch DDP, gloo, 2 processes).

fairseq's --cpu cannot run multi-process training, so this builds the model and criterion
with fairseq's own task/config machinery and wraps the model as fairseq does
(``DistributedDataParallel`` inside ``ModuleProxyWrapper``). The gradient averaged over two
processes, each on half a batch, must equal the single-process gradient of the whole batch
(the criterion's loss is a sum, so the full-batch gradient is twice the average).
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import REPO

pytestmark = pytest.mark.slow


#: the architectures, as fairseq-train options: the LSTM (the search inside its forward) and the Transformers
#: (the decoder driven through its incremental state after the DDP-wrapped teacher-forcing forward)
ARCHITECTURES = {
    "softtopk_lstm": ["--arch", "softtopk_lstm_tiny"],
    "softtopk_transformer": ["--arch", "softtopk_transformer_tiny"],
    "transformer": ["--arch", "transformer", "--encoder-embed-dim", "16", "--decoder-embed-dim", "16",
                    "--encoder-ffn-embed-dim", "24", "--decoder-ffn-embed-dim", "24", "--encoder-layers", "1",
                    "--decoder-layers", "2", "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"],
}


def _build(data_bin, user_dir, mode, architecture="softtopk_lstm"):
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    import fairseq_softtopk

    fairseq_softtopk.register()  # the parser's --arch choices are fixed when it is built
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [
        str(data_bin), "--user-dir", str(user_dir), *ARCHITECTURES[architecture], "--dropout", "0",
        "--criterion", "soft_beam_search", "--train-beam", "3", "--topk-mode", mode, "--topk-epsilon", "0.5",
        "--topk-tol", "1e-9", "--teacher-forcing-ratio", "0.5", "--cpu"])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    task.load_dataset("train")
    torch.manual_seed(0)
    model = task.build_model(cfg.model).double()
    criterion = task.build_criterion(cfg.criterion)
    dataset = task.dataset("train")
    return model, criterion, dataset


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


#: every case the test compares: (topk mode, architecture)
CASES = [(mode, architecture) for mode in ("soft", "hard") for architecture in sorted(ARCHITECTURES)]


def _worker(rank, world, store_path, data_bin, user_dir, out_dir):
    """One rank: every case in turn, on its half of sentences 0..11; rank 0 saves each averaged gradient."""
    from fairseq.distributed import ModuleProxyWrapper
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    # a file rendezvous: no rank hosts a store server that the other could lose while leaving
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    for mode, architecture in CASES:
        model, criterion, dataset = _build(data_bin, user_dir, mode, architecture)
        indices = list(range(rank * 6, rank * 6 + 6))
        sample = dataset.collater([dataset[i] for i in indices])
        wrapped = ModuleProxyWrapper(DistributedDataParallel(model))
        loss, _, _ = criterion(wrapped, sample)
        loss.backward()
        if rank == 0:
            torch.save(_grads(model), out_dir / f"{mode}-{architecture}.pt")
    # both ranks leave together: a rank that tears its group down while the other still finishes the last
    # gradient exchange closes its sockets under it, and gloo's thread on the other side aborts the process
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_gradients(toy_data_bin, tmp_path_factory):
    """``{(mode, architecture): gradient averaged over 2 processes}``: one pair of processes runs every case
    (starting the processes, which import fairseq, costs more than a case)."""
    import fairseq  # noqa: F401  (so that importing the plugin registers it)

    _, data_bin = toy_data_bin
    out_dir = tmp_path_factory.mktemp("ddp")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(2, out_dir / "rendezvous", data_bin, REPO / "fairseq_softtopk", out_dir),
             nprocs=2, join=True)
    return {case: torch.load(out_dir / f"{case[0]}-{case[1]}.pt") for case in CASES}


@pytest.mark.parametrize("mode, architecture", CASES)
def test_ddp_gradients_match_single_process(ddp_gradients, toy_data_bin, repo_root, mode, architecture):
    _, data_bin = toy_data_bin
    model, criterion, dataset = _build(data_bin, repo_root / "fairseq_softtopk", mode, architecture)
    sample = dataset.collater([dataset[i] for i in range(12)])
    loss, _, _ = criterion(model, sample)
    loss.backward()
    single = _grads(model)
    assert float(single.abs().max()) > 0
    torch.testing.assert_close(2 * ddp_gradients[mode, architecture], single, rtol=1e-6, atol=1e-9)
