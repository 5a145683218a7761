"""The storage and ``comm`` used outside any detectron2 trainer: a storage opened around a
Lightning fit and stepped by the task (with a second storage nested inside it while the model
is prepared for quantization), throwaway storages around one training forward in model tests,
and the single-process paths of ``comm`` that data loading and evaluation code call
(``get_local_rank``, ``all_gather``, ``synchronize``, ``gather``, ``shared_random_seed``)."""

from __future__ import annotations

import io
import itertools
import os

import numpy as np
import torch

from compat.harness import pattern

from ._common import TinyDetector, batches, log, sgd


class _RCNNStandIn(TinyDetector):
    """What ``GeneralizedRCNN.forward`` does with the storage in training: the heads put their
    statistics (``roi_head/num_fg_samples``, ``fast_rcnn/cls_accuracy``), and every
    ``vis_period`` iterations of ``get_event_storage().iter`` ``visualize_training`` puts one
    picture, an HWC uint8 numpy image (GT beside proposals) transposed to CHW."""

    def __init__(self, E, vis_period=0):
        super().__init__()
        self.E = E
        self.vis_period = vis_period

    def forward(self, batch):
        out = super().forward(batch)
        if not self.training:
            return out
        storage = self.E.get_event_storage()
        storage.put_scalar("roi_head/num_fg_samples", float((batch[:, 0] > 0).sum()))
        storage.put_scalar("fast_rcnn/cls_accuracy", float((batch[:, 1] > 0).float().mean()))
        if self.vis_period > 0 and storage.iter % self.vis_period == 0:
            level = (storage.iter * 53) % 256
            anno_img = np.full((4, 3, 3), level, dtype=np.uint8)
            prop_img = np.full((4, 3, 3), level // 2, dtype=np.uint8)
            vis_img = np.concatenate((anno_img, prop_img), axis=1).transpose(2, 0, 1)
            storage.put_image("Left: GT bounding boxes;  Right: Predicted proposals", vis_img)
        return out


def _images(storage):
    """What a TensorBoard writer would take from the storage: name, shape, sum, iteration."""
    return [(name, list(img.shape), int(img.sum()), it) for name, img, it in storage._vis_data]


# --- facebookresearch/d2go --------------------------------------------------------------------


@pattern(
    "facebookresearch/d2go",
    "d2go/trainer/lightning/training_loop.py: _do_train, _do_test; "
    "d2go/runner/lightning_task.py: DefaultTask._standard_training_step; "
    "d2go/modeling/meta_arch/rcnn.py: _fx_quant_prepare",
)
def ot_d2go_lightning_storage_stepped_by_task(E, R):
    """d2go trains with PyTorch Lightning, not a detectron2 trainer: ``_do_train`` opens
    ``with EventStorage() as storage:``, sets ``task.storage = storage`` and calls
    ``trainer.fit(task)``; each ``training_step`` runs the meta-architecture (which reads
    ``get_event_storage()`` and puts its statistics and a visualisation every ``vis_period``),
    sums the losses, adds ``total_loss`` to the dict handed to ``log_dict``, and calls
    ``self.storage.step()``. When QAT starts mid-fit, ``_fx_quant_prepare`` runs the model on an
    example input under its own ``with EventStorage() as _:`` (so the R-CNN losses have a
    storage), nested inside the training one. ``_do_test`` then opens a fresh storage for
    ``trainer.test(task)``. Lightning's loop is a plain loop here; ``log_dict`` is recorded."""

    class Task:  # stands in for GeneralizedRCNNTask (a LightningModule)
        def __init__(self):
            self.model = _RCNNStandIn(E, vis_period=2)
            self.storage = None

        def training_step(self, batch, batch_idx):
            loss_dict = self.model(batch)
            losses = sum(loss_dict.values())
            loss_dict["total_loss"] = losses
            self.storage.step()
            R.rec("log_dict", batch_idx, {k: v.item() for k, v in loss_dict.items()})
            return losses

        def prepare_for_quant(self):  # _fx_quant_prepare's example run
            with E.EventStorage() as _:
                with torch.no_grad():
                    self.model(torch.ones(2, 4))
                R.storage(_, "quant prepare storage")
            R.rec("outer storage is current again", E.get_event_storage() is self.storage)

    task = Task()
    optimizer = sgd(task.model)
    data = batches(seed=5)
    with E.EventStorage() as storage:  # _do_train
        task.storage = storage
        for batch_idx in range(5):  # trainer.fit(task)
            if batch_idx == 3:  # the QAT callback's start step
                task.prepare_for_quant()
            loss = task.training_step(next(data), batch_idx)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        R.storage(storage, "train storage")
        R.rec("images", _images(storage))
        R.rec("accuracy median", storage.history("fast_rcnn/cls_accuracy").median(3))
    task.model.eval()
    with E.EventStorage() as storage:  # _do_test
        task.storage = storage
        with torch.no_grad():
            out = task.model(next(data))
        R.rec("test output", out)
        R.storage(storage, "test storage")
    try:
        E.get_event_storage()
    except AssertionError as e:
        R.rec("no storage after test", str(e))


@pattern(
    "facebookresearch/d2go",
    "d2go/data/utils.py: local_master_get_detection_dataset_dicts; "
    "d2go/data/disk_cache.py: _local_master_gather, DiskCachedList._initialize_diskcache",
)
def ot_d2go_local_master_dataset_dicts(E, R):
    """d2go loads the dataset dicts on each machine's local master only: ``comm.get_local_rank()
    == 0`` loads them (the others keep ``[]``), ``comm.synchronize()``, then every rank takes the
    size from ``comm.all_gather(len(dataset_dicts))[0]`` and a non-master wraps it in a fake
    list. Its disk cache agrees on one directory with ``comm.all_gather(cache_dir)[0]`` and
    gathers values computed on local masters with ``_local_master_gather`` (``None`` elsewhere,
    filtered out; ``check_equal`` asserts they agree). In one process every call is the
    single-process path."""
    comm = E.comm

    def load_dicts():
        return [{"image_id": i, "annotations": [{"category_id": i % 3}]} for i in range(7)]

    dataset_dicts = load_dicts() if comm.get_local_rank() == 0 else []
    comm.synchronize()
    dataset_size = comm.all_gather(len(dataset_dicts))[0]
    R.rec("dataset size", dataset_size, comm.get_local_rank(), len(dataset_dicts))

    cache_dir = comm.all_gather(os.path.join(R.out, "DatasetFromList_cache", "0a1b2c3d"))[0]
    R.rec("cache dir", cache_dir)

    def local_master_gather(func, check_equal=False):
        x = func() if comm.get_local_rank() == 0 else None
        x_all = comm.all_gather(x)
        x_local_master = [x for x in x_all if x is not None]
        if check_equal:
            master = x_local_master[0]
            assert all(x == master for x in x_local_master), x_local_master
        return x_local_master

    R.rec("gathered", local_master_gather(lambda: dataset_size * 2, check_equal=True))
    R.rec("world", comm.get_world_size(), comm.get_rank(), comm.is_main_process())
    log.info("Serialized dataset of %d dicts in %s", dataset_size, cache_dir)


# --- facebookresearch/Detic -------------------------------------------------------------------


@pattern(
    "facebookresearch/Detic",
    "detic/data/custom_dataset_dataloader.py: MultiDatasetSampler, "
    "build_multi_dataset_batch_data_loader",
)
def ot_detic_multi_dataset_sampler_seed(E, R):
    """Detic's ``MultiDatasetSampler`` counts the images of each source dataset, takes
    ``seed = comm.shared_random_seed()`` when none is given (kept as ``int(seed)``), reads
    ``comm.get_rank()`` and ``comm.get_world_size()``, weights every image by its dataset's
    ratio, and yields ``torch.multinomial`` draws from a generator seeded with that seed,
    sliced by rank. The batch loader divides the total batch size by
    ``get_world_size()`` after asserting it divides. The process seeds numpy first, as
    detectron2's ``seed_all_rng`` does, so the shared seed is deterministic."""
    comm = E.comm
    np.random.seed(1234)

    class MultiDatasetSampler(torch.utils.data.Sampler):
        def __init__(self, dataset_dicts, dataset_ratio, seed=None):
            sizes = [0 for _ in range(len(dataset_ratio))]
            for d in dataset_dicts:
                sizes[d["dataset_source"]] += 1
            print("dataset sizes", sizes)
            self.sizes = sizes
            if seed is None:
                seed = comm.shared_random_seed()
            self._seed = int(seed)
            self._rank = comm.get_rank()
            self._world_size = comm.get_world_size()
            self.dataset_ids = torch.tensor(
                [d["dataset_source"] for d in dataset_dicts], dtype=torch.long
            )
            weights = [
                torch.ones(s) * max(sizes) / s * r / sum(dataset_ratio)
                for r, s in zip(dataset_ratio, sizes)
            ]
            self.weights = torch.cat(weights)
            self.sample_epoch_size = len(self.weights)

        def __iter__(self):
            start = self._rank
            yield from itertools.islice(self._infinite_indices(), start, None, self._world_size)

        def _infinite_indices(self):
            g = torch.Generator()
            g.manual_seed(self._seed)
            while True:
                ids = torch.multinomial(
                    self.weights, self.sample_epoch_size, generator=g, replacement=True
                )
                yield from ids.tolist()

    dicts = [{"dataset_source": 0}] * 6 + [{"dataset_source": 1}] * 2
    sampler = MultiDatasetSampler(dicts, dataset_ratio=[1, 4])
    R.rec("seed", sampler._seed, sampler._rank, sampler._world_size)
    R.rec("first draws", list(itertools.islice(iter(sampler), 12)))
    total_batch_size = 4
    world_size = comm.get_world_size()
    assert total_batch_size > 0 and total_batch_size % world_size == 0
    R.rec("batch size per gpu", total_batch_size // world_size)
    second = MultiDatasetSampler(dicts, dataset_ratio=[1, 4])
    R.rec("second seed differs", second._seed != sampler._seed)


# --- facebookresearch/detectron2 (DensePose) --------------------------------------------------


@pattern(
    "facebookresearch/detectron2",
    "projects/DensePose/densepose/evaluation/evaluator.py: DensePoseCOCOEvaluator.evaluate; "
    "evaluation/tensor_storage.py: _ram_storage_gather",
)
def ot_densepose_evaluator_gather(E, R):
    """DensePose's evaluator built with ``distributed=True`` (as ``DefaultTrainer.build_evaluator``
    does): ``process`` tags each prediction kept in a RAM tensor storage with its record id
    and ``get_rank()``; ``evaluate`` calls ``synchronize()``, ``gather(self._predictions)`` and
    chains the per-rank lists, then ``_ram_storage_gather`` rewinds the storage's buffer and
    ``gather``s its bytes to ``dst=0``, returning nothing on other ranks; only
    ``is_main_process()`` goes on to evaluate. The COCO evaluation is a stand-in summary."""
    comm = E.comm

    class RamStorage:  # SingleProcessRamTensorStorage: fixed-size float32 records
        def __init__(self, buf):
            self.storage_impl = buf
            self.next_record_id = 0

        def put(self, tensor):
            self.storage_impl.write(tensor.numpy().astype(np.float32).tobytes())
            self.next_record_id += 1
            return self.next_record_id - 1

    class Evaluator:
        def __init__(self, distributed, storage):
            self._distributed = distributed
            self._storage = storage

        def reset(self):
            self._predictions = []

        def process(self, inputs, outputs):
            for image_id, out in zip(inputs, outputs):
                prediction = {"image_id": image_id, "score": round(float(out.sum()), 6)}
                prediction["record_id"] = self._storage.put(out)
                prediction["rank"] = comm.get_rank()
                self._predictions.append(prediction)

        def _ram_storage_gather(self, dst_rank=0):
            self._storage.storage_impl.seek(0, os.SEEK_SET)
            data_list = comm.gather(self._storage.storage_impl.read(), dst=dst_rank)
            if comm.get_rank() != dst_rank:
                return None
            return {i: len(data) for i, data in enumerate(data_list)}

        def evaluate(self):
            if self._distributed:
                comm.synchronize()
                predictions = comm.gather(self._predictions)
                predictions = list(itertools.chain(*predictions))
            else:
                predictions = self._predictions
            multi_storage = self._ram_storage_gather()
            if not comm.is_main_process():
                return None
            log.info("Evaluating %d predictions ...", len(predictions))
            return {"densepose_gps": {"AP": 100.0 * len(predictions) / 6}, "bytes": multi_storage}

    evaluator = Evaluator(distributed=True, storage=RamStorage(io.BytesIO()))
    evaluator.reset()
    model = TinyDetector().eval()
    data = batches(seed=6, size=2)
    with torch.no_grad():
        for step in range(3):
            batch = next(data)
            evaluator.process([2 * step, 2 * step + 1], list(model(batch)))
    R.rec("results", evaluator.evaluate())
    R.rec("predictions", evaluator._predictions)


# --- facebookresearch/detectron2 (model tests) ------------------------------------------------


@pattern(
    "facebookresearch/detectron2",
    "tests/modeling/test_model_e2e.py: InstanceModelE2ETest._test_train",
)
def ot_d2_test_model_e2e_throwaway_storage(E, R):
    """detectron2's end-to-end model tests run one training forward of a fresh model inside a
    bare ``with EventStorage():`` (R-CNN's heads need a storage for their statistics), call
    ``backward()`` on the summed losses and drop the storage: ``test_empty_data`` and
    ``test_half_empty_data`` each open their own, so both start at iteration 0 and nothing the
    first put is seen by the second. The model visualises at ``vis_period=1`` here. Outside
    the blocks there is no storage: the eval forward does not ask for one."""
    torch.manual_seed(43)
    model = _RCNNStandIn(E, vis_period=1)

    def test_train(inputs):
        model.train()
        with E.EventStorage() as storage:
            losses = model(inputs)
            sum(losses.values()).backward()
            del losses
            R.storage(storage)
            R.rec("images", _images(storage))
            R.rec("smoothed", storage.latest_with_smoothing_hint(20))
            R.rec("count", storage.count_samples("roi_head/num_fg_samples", 20))
        return storage

    model.eval()
    with torch.no_grad():
        R.rec("eval output", model(torch.zeros(2, 4)))
    first = test_train(torch.zeros(2, 4))
    second = test_train(torch.rand(2, 4))
    R.rec("two storages", first is not second, first.iter, second.iter)
    try:
        E.get_event_storage()
    except AssertionError:
        R.rec("no storage after the tests")
