"""`import patchkit` and the CLI's --help stay light: no torch dynamo, no transformers modeling code, no torch."""

from __future__ import annotations

import resource
import sys

import pytest
from entrypoints import clean_env, run, run_loaded

pytestmark = pytest.mark.heavy  # each test starts Python processes: make test-heavy

HEAVY = ("torch", "torch._dynamo", "transformers", "transformers.modeling_utils")


def loaded_after(code: str) -> dict[str, bool]:
    """Which HEAVY modules a fresh interpreter holds after `code`."""
    proc, loaded = run_loaded(code, env=clean_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {m: m in loaded for m in HEAVY}


def test_import_patchkit_loads_neither_dynamo_nor_transformers_modeling_code():
    assert loaded_after("import patchkit") == dict.fromkeys(HEAVY, False)
    # the public names still resolve, and loading them is what imports the heavy code
    assert loaded_after("import patchkit\npatchkit.apply_patch")["transformers.modeling_utils"]


@pytest.mark.parametrize("first", ["import patchkit", "from patchkit import apply_patch",
                                   "import patchkit.hooks.family_route"])
def test_the_registered_name_is_patchkits_own_whichever_patchkit_module_loads_first(first):
    """transformers loads after patchkit: the name is patchkit's, its attention and its mask. Importing family_route
    (as `patchkit.apply_patch` does, or the eras table, the gates, the doctor) imports patchkit's attention, which
    registers its name and reads the table's refusals: patches/table.py imported family_route back, half-initialised,
    and the name stayed unregistered until a call of apply_patch() or register_attention(): transformers refused
    attn_implementation="patchkit"."""
    code = (f"{first}\nimport transformers as tf\n"
            "config = tf.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,\n"
            "                        num_attention_heads=4, attn_implementation='patchkit')\n"
            "model = tf.LlamaForCausalLM(config)\n"
            "from patchkit.hooks.name import attention_interface as ai\n"
            "print(model.config._attn_implementation,\n"
            "      tf.modeling_utils.AttentionInterface._global_mapping['patchkit'] is ai._attention,\n"
            "      tf.masking_utils.AttentionMaskInterface._global_mapping['patchkit'] is ai.mask_function)")
    proc = run([sys.executable, "-c", code], env=clean_env())
    assert proc.returncode == 0 and proc.stdout.split() == ["patchkit", "True", "True"], proc.stderr[-2000:]


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["doctor", "--help"], ["verify", "--help"]])
def test_cli_help_answers_without_torch(argv):
    code = (f"import sys\nfrom patchkit.entry.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
            "print('TORCH', 'torch' in sys.modules)")
    proc = run([sys.executable, "-c", code], env=clean_env())
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "TORCH False"


def cpu_seconds(code: str) -> float:
    """CPU seconds (user + system) of a fresh interpreter running `code`: stable on a loaded machine, unlike wall."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = run([sys.executable, "-c", code], env=clean_env())
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def test_import_patchkit_costs_under_a_cpu_second_beyond_torch():
    torch_alone = min(cpu_seconds("import torch") for _ in range(2))
    both = min(cpu_seconds("import torch\nimport patchkit") for _ in range(2))
    assert both - torch_alone < 1.0, (both, torch_alone)
