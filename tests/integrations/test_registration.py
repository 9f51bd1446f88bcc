"""``import quantpack`` stays fast (no transformers) yet ``from_pretrained`` still finds the quantizer
(each import-order case runs in a fresh interpreter), and the quantizer explains its refusals.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from test_loader import llama_src, packed_llama  # noqa: F401


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_import_quantpack_and_its_cli_do_not_import_transformers():
    out = _run("""
        import sys
        import quantpack, quantpack.cli, quantpack.integrations.peft
        print(sorted(m for m in sys.modules if m == "transformers" or m.startswith("transformers.")))
    """)
    assert out.strip() == "[]"


def test_quantpack_first_then_from_pretrained(packed_llama):
    out = _run(f"""
        import sys
        import quantpack
        assert "transformers" not in sys.modules
        from transformers import AutoModelForCausalLM
        from quantpack.modules.linear import QuantLinear
        model = AutoModelForCausalLM.from_pretrained({str(packed_llama)!r})
        print(type(model.config.quantization_config).__name__,
              sum(isinstance(m, QuantLinear) for m in model.modules()))
    """)
    name, quantized = out.split()[-2:]
    assert name == "QuantpackConfig" and int(quantized) > 0


def test_transformers_registry_first_then_quantpack():
    out = _run("""
        from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
        assert "quantpack" not in AUTO_QUANTIZER_MAPPING
        import quantpack.integrations.transformers as hf
        assert AUTO_QUANTIZER_MAPPING["quantpack"] is hf.QuantpackHfQuantizer
        assert AUTO_QUANTIZATION_CONFIG_MAPPING["quantpack"] is hf.QuantpackConfig
        print("ok")
    """)
    assert out.strip() == "ok"


@pytest.mark.parametrize("first", [
    "from quantpack.integrations.transformers import QuantpackConfig",
    "import quantpack.integrations.transformers as hf; hf.register(); hf.register()",
    "import quantpack; import quantpack.integrations.transformers",
])
def test_first_use_in_a_fresh_interpreter_registers(first):
    """Whatever loads transformers' registry first (including quantpack's own quantizer module,
    whose import triggers the hook mid-import), the entries end up written."""
    out = _run(f"""
        {first}
        from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING
        import quantpack.integrations.transformers as hf
        assert AUTO_QUANTIZER_MAPPING["quantpack"] is hf.QuantpackHfQuantizer
        assert AUTO_QUANTIZATION_CONFIG_MAPPING["quantpack"] is hf.QuantpackConfig
        print("ok")
    """)
    assert out.strip() == "ok"


def test_save_pretrained_refusal_says_why(packed_llama, tmp_path, caplog):
    """transformers refuses with "check out the warnings from the logger": there must be one."""
    from transformers import AutoModelForCausalLM

    import quantpack  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(packed_llama)
    with caplog.at_level("WARNING", logger="quantpack"), pytest.raises(ValueError, match="not serializable"):
        model.save_pretrained(tmp_path / "resaved")
    assert "quantpack convert" in caplog.text and "manifest" in caplog.text
    assert not (tmp_path / "resaved").exists() or not any((tmp_path / "resaved").iterdir())


def test_a_transformers_without_loading_attribute_types_registers_and_says_once_that_verify_false_needs_5_4():
    """Before 5.4 transformers had no LOADING_ATTRIBUTES_CONFIG_TYPES: registering must not need it (loading
    through such a transformers is what the floors CI job runs), and asking for verify=False says in one line that
    checksums stay on."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import transformers.quantizers.auto as auto
        vars(auto).pop("LOADING_ATTRIBUTES_CONFIG_TYPES", None)
        import quantpack
        from quantpack.integrations.transformers import QuantpackConfig
        assert auto.AUTO_QUANTIZATION_CONFIG_MAPPING["quantpack"] is QuantpackConfig
        QuantpackConfig(verify=False); QuantpackConfig(verify=False); QuantpackConfig()
        print("ok")
    """)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "verify=False" in line]
    assert len(lines) == 1 and "transformers >= 5.4" in lines[0] and "quantpack.load" in lines[0], proc.stderr


def test_the_import_hook_never_breaks_transformers():
    """Whatever fails in quantpack's registration (here: its quantizer module cannot be imported), transformers
    still loads its models, and one line says what quantpack cannot do."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys
        import quantpack
        sys.modules["quantpack.integrations.transformers"] = None  # (its import now raises)
        from transformers import LlamaConfig, LlamaForCausalLM
        LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
        print("ok")
    """)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("quantpack:")]
    assert len(lines) == 1 and "cannot register" in lines[0] and "quantpack.load" in lines[0], proc.stderr
