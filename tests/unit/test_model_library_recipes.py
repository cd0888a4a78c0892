"""recipe=timm and recipe=hf_causal_lm without training: what they take from the libraries (sizes, blocks, norms)
and what they refuse. Skipped when the optional package is absent."""

from __future__ import annotations

import pytest
import torch

from ampctl.errors import UsageError

CORPUS = {"max_corpus_bytes": 100_000}


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def timm():
    return pytest.importorskip("timm")


def hf(**kwargs):
    from ampctl.recipes.hf_causal_lm import HFCausalLMRecipe

    return HFCausalLMRecipe(**{"block_size": 32, "batch_size": 2, **CORPUS, **kwargs})


def test_size_small_keeps_the_librarys_ratios(transformers):
    """Llama's feed-forward is 11008/4096 of its width, Mistral has 8 key/value heads for 32: a small model keeps
    both, and a width the user chooses drives the widths derived from it."""
    llama = hf().model_config
    assert (llama.hidden_size, llama.num_hidden_layers, llama.num_attention_heads) == (256, 4, 4)
    assert llama.intermediate_size == 688 and llama.head_dim == 64 and llama.vocab_size == 256
    mistral = hf(model_type="mistral").model_config
    assert mistral.num_key_value_heads == 1 and mistral.intermediate_size == 896  # 14336/4096 x 256
    wider = hf(config={"hidden_size": 512, "num_attention_heads": 8}).model_config
    assert wider.intermediate_size == 1376 and wider.head_dim == 64 and wider.num_key_value_heads == 8
    gpt2 = hf(model_type="gpt2", config={"n_embd": 128}).model_config  # GPT-2's own name for the width
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_positions, gpt2.vocab_size) == (128, 4, 32, 256)
    assert gpt2.bos_token_id is None  # 50256 lies outside a byte vocabulary


def test_size_library_is_the_config_classs_own(transformers):
    recipe = hf(size="library", block_size=64, config={"num_hidden_layers": 1})
    config = recipe.model_config  # Llama's 4096-wide layer is never built
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (4096, 11008, 1)


@pytest.mark.parametrize("kwargs,message", [
    ({"model_type": "lama"}, r"recipe.model_type='lama': no causal language model .*\(did you mean llama\?\)"),
    ({"config": {"hiden_size": 3}}, r"recipe.config.hiden_size: LlamaConfig has no such field \(did you mean "
                                    r"recipe.config.hidden_size\?\)"),
    ({"config": {"num_attention_heads": 3}}, r"LlamaConfig refused size=small with recipe.config "
                                             r"\{num_attention_heads: 3\}: The hidden size \(256\) is not a multiple"),
    ({"size": "big"}, r"recipe.size='big' is not allowed: expected small \| library"),
    ({"attn_implementation": "flash"}, r"recipe.attn_implementation='flash' is not allowed"),
    ({"block_size": 64, "config": {"max_position_embeddings": 32}}, r"recipe.block_size=64 is longer than"),
    ({"tokenizer": "/nonexistent/tokenizer"}, r"recipe.tokenizer='/nonexistent/tokenizer' holds no tokenizer"),
])
def test_hf_refusals_name_the_key(transformers, kwargs, message):
    with pytest.raises(UsageError, match=message):
        hf(**kwargs)


def test_a_local_tokenizer_sets_the_vocabulary_and_special_tokens(transformers, tmp_path):
    """A tokenizer directory as tokenizer.save_pretrained() writes it (a byte-level BPE trained here: no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from ampctl.recipes.text import read_corpus

    text = read_corpus(None, 200_000).decode("utf-8", errors="replace")
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    fast.save_pretrained(tmp_path / "tok")
    recipe = hf(tokenizer=str(tmp_path / "tok"), max_corpus_bytes=50_000)
    config = recipe.model_config
    assert config.vocab_size == len(fast) and config.eos_token_id == fast.eos_token_id
    idx, targets = next(recipe.batches(torch.device("cpu"), 0))
    assert idx.shape == (2, 32) and int(idx.max()) < len(fast) and torch.equal(idx[:, 1:], targets[:, :-1])


@pytest.mark.parametrize("model_type,block", [("llama", "LlamaDecoderLayer"), ("gpt2", "GPT2Block")])
def test_hf_blocks_are_the_models_no_split_modules(transformers, model_type, block):
    recipe = hf(model_type=model_type)
    model = recipe.build_model()
    blocks = recipe.activation_checkpoint_blocks(model)
    assert [type(b).__name__ for b in blocks] == [block] * 4


def test_o2_keeps_library_norms_in_fp32(transformers):
    """LlamaRMSNorm is transformers' own class, not torch's: O2's rule type=norm keeps it (and timm's RmsNorm) fp32
    all the same."""
    from ampctl.conf.precision_schema import LayerRule
    from ampctl.engine.precision.half import cast_model_to_half
    from ampctl.engine.precision.layers import matches

    model = hf().build_model()
    o2_rule = LayerRule(run_in="fp32", type="norm")
    cast_model_to_half(model, torch.float16, [n for n, m in model.named_modules() if matches(o2_rule, n, m)],
                       torch.device("cpu"))
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    norms = [n for n in dtypes if "norm" in n]
    assert norms and all(dtypes[n] == torch.float32 for n in norms)
    assert all(dtypes[n] == torch.float16 for n in dtypes if n not in norms)


@pytest.mark.parametrize("model,blocks,nhwc", [
    ("test_resnet", ["layer1.0", "layer2.0", "layer3.0", "layer4.0"], True),
    ("test_vit", [f"blocks.{i}" for i in range(6)], False),
    ("test_convnext", ["stages.0.blocks.0", "stages.1.downsample", "stages.1.blocks.0"], True),
])
def test_timm_blocks_are_its_group_matchers_and_cnns_go_channels_last(timm, model, blocks, nhwc):
    from ampctl.recipes.timm_models import TimmRecipe

    recipe = TimmRecipe(model=model, image_size=32, batch_size=2, num_classes=10)
    built = recipe.build_model()
    names = {id(m): name for name, m in built.named_modules()}
    found = [names[id(b)] for b in recipe.activation_checkpoint_blocks(built)]
    assert found[:len(blocks)] == blocks
    x, y = next(recipe.batches(torch.device("cpu"), 0))
    assert x.shape == (2, 3, 32, 32) and int(y.max()) < 10
    assert x.is_contiguous(memory_format=torch.channels_last) == nhwc
    assert next(p for p in built.parameters() if p.dim() == 4).is_contiguous(memory_format=torch.channels_last) == nhwc


@pytest.mark.parametrize("kwargs,message", [
    ({"model": "vit_tiny_patch16"}, r"recipe.model='vit_tiny_patch16': no such timm model \(did you mean "),
    ({"data": "imagenet"}, r"recipe.data='imagenet' is not allowed: expected synthetic \| imagefolder"),
    ({"data": "imagefolder"}, r"recipe.data=imagefolder needs recipe.data_root"),
    ({"checkpoint": "/nonexistent.pth"}, r"recipe.checkpoint='/nonexistent.pth' is not a file"),
])
def test_timm_refusals_name_the_key(timm, kwargs, message):
    from ampctl.recipes.timm_models import TimmRecipe

    with pytest.raises(UsageError, match=message):
        TimmRecipe(**kwargs)


def test_timm_model_kwargs_the_model_does_not_take(timm):
    from ampctl.recipes.timm_models import TimmRecipe

    with pytest.raises(UsageError, match=r"recipe.model_kwargs.depth: test_resnet takes no such argument"):
        TimmRecipe(model="test_resnet", model_kwargs={"depth": 2}).build_model()


def test_a_timm_checkpoint_is_loaded_and_a_mismatched_one_refused(timm, tmp_path):
    from ampctl.recipes.timm_models import TimmRecipe

    source = timm.create_model("test_vit", num_classes=10, img_size=32)
    torch.save(source.state_dict(), tmp_path / "w.pth")
    loaded = TimmRecipe(model="test_vit", image_size=32, num_classes=10, checkpoint=str(tmp_path / "w.pth"))
    weights = loaded.build_model().state_dict()
    assert all(torch.equal(weights[k], v) for k, v in source.state_dict().items())
    wrong = TimmRecipe(model="test_vit", image_size=32, num_classes=5, checkpoint=str(tmp_path / "w.pth"))
    with pytest.raises(UsageError, match=r"recipe.checkpoint=.* could not be loaded into test_vit"):
        wrong.build_model()


def test_recipe_titles_name_the_model():
    from ampctl.recipes.base import recipe_title

    assert recipe_title("timm", {"model": "vit_base_patch16_224"}) == "timm (vit_base_patch16_224)"
    assert recipe_title("hf_causal_lm", {"model_type": "llama"}) == "hf_causal_lm (llama)"
    assert recipe_title("gpt", {"d_model": 256}) == "gpt"


class _BrokenTorchvision:
    """A meta path finder whose modules fail as a torchvision built for another torch does on import."""

    def __init__(self, *names: str) -> None:
        self.names = names

    def find_spec(self, name, path, target=None):
        if name in self.names:
            import importlib.util

            return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise RuntimeError("operator torchvision::nms does not exist")


def test_a_torchvision_built_for_another_torch_is_one_line_naming_both_and_the_fix(monkeypatch):
    import sys
    from importlib import metadata

    from ampctl.errors import UsageError
    from ampctl.recipes.libraries import import_library

    versions = {"torch": "2.13.0+cpu", "torchvision": "0.29.1"}
    monkeypatch.setattr(metadata, "version", lambda name: versions[name])
    monkeypatch.setattr(metadata, "requires", lambda name: ["numpy", "torch (>=2.14.0)", "pillow (>=5.3.0)"])
    monkeypatch.delitem(sys.modules, "timm", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenTorchvision("timm"), *sys.meta_path])
    with pytest.raises(UsageError) as refused:
        import_library("timm", "recipe=timm", extra="timm")
    assert str(refused.value) == (
        "recipe=timm: torchvision 0.29.1 does not match torch 2.13.0+cpu (it was built for torch>=2.14.0): its "
        "compiled operators are missing (operator torchvision::nms); replace it with the torchvision built for this "
        "torch (the same version number can be another build, which a plain pip install keeps): pip install "
        "--force-reinstall --no-deps 'torchvision==0.28.*' --index-url https://download.pytorch.org/whl/cpu")


def test_a_library_that_is_not_installed_names_its_extra(monkeypatch):
    import sys

    from ampctl.errors import UsageError
    from ampctl.recipes.libraries import import_library

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    with pytest.raises(UsageError, match=r"^recipe=hf_causal_lm: the transformers package is not installed; "
                                         r"pip install 'ampctl\[transformers\]'$"):
        import_library("transformers", "recipe=hf_causal_lm", extra="transformers")
