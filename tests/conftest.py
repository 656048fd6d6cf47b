import pytest


@pytest.fixture(scope="session")
def default_model_path():
    """The bundled SmolLM2 folder (converted once by `make setup`, or here on first use)."""
    from engine.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory, default_model_path):
    """A 2-layer random-weight Llama with the default model's tokenizer: fast engine tests."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (default_model_path / name).exists():
            shutil.copy(default_model_path / name, path / name)
    return path


@pytest.fixture
def record_schedules():
    """`record(core)` wraps the core's Scheduler.schedule for this test and returns the list
    it fills: per step, (SchedulerOutput, ids of requests given a prefill chunk that leaves
    tokens uncomputed) - the second judged at schedule time, before the step runs."""
    wrapped = []

    def record(core):
        steps = []
        original = core.scheduler.schedule

        def recording():
            out = original()
            partial = [r.request_id for r, n in zip(out.scheduled, out.num_scheduled_tokens)
                       if r.num_computed_tokens + n < r.num_tokens]
            steps.append((out, partial))
            return out

        core.scheduler.schedule = recording
        wrapped.append((core.scheduler, original))
        return steps

    yield record
    for scheduler, original in wrapped:
        scheduler.schedule = original
