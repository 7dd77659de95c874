"""engine.bench's synthetic model, the part that runs without a GPU."""

import torch

from engine import bench, quant, store


def test_a_random_expert_unpacks_to_mixtral_like_weights():
    cfg = bench.ModelConfig(**{**bench.MIXTRAL, "num_layers": 1, "hidden_size": 64, "intermediate_size": 128})
    for bits, spec in quant.EXPERT_SPECS.items():
        eq = {"bits": bits, "group_size": spec.group_size, "meta_group": spec.meta_group}
        fields, stride = store.expert_layout(cfg, eq)
        buf = bench.random_expert(cfg, spec, fields, stride, "cpu", torch.Generator().manual_seed(bits))
        assert buf.shape == (stride,) and buf.dtype == torch.uint8
        views = bench.expert_views(cfg, fields, eq)(buf)
        for name in store.EXPERT_MATRICES:
            assert (views[name].rows, views[name].cols) == store.expert_shape(cfg, name)
            w = quant.dequantize(views[name], torch.float32)
            # HQQ on weights of std ~0.01 (Mixtral's are 0.01-0.02): zero-centred, similar spread
            assert 0.005 < float(w.std()) < 0.015 and abs(float(w.mean())) < 0.003, (bits, name)
