"""What an algorithm or a callback tells the engine is explicit: one ``is_overridden``, flags kept or reported in
one warning, the package's public face."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
from lightning.pytorch import Callback

from lightning_dfl.callbacks.base import FederatedCallback
from lightning_dfl.federation.algorithms import DisPFL, FedAvg
from lightning_dfl.federation.algorithms.base import Algorithm, FlagsLostWarning
from lightning_dfl.federation.loop.callback_hooks import defined_hooks
from lightning_dfl.hooks import is_overridden


class _Base:
    def hook(self):
        pass

    @classmethod
    def made(cls):
        pass

    @staticmethod
    def pure():
        pass


class _Same(_Base):
    pass


class _Own(_Base):
    def hook(self):
        pass

    @classmethod
    def made(cls):
        pass

    @staticmethod
    def pure():
        pass


@pytest.mark.parametrize("hook", ["hook", "made", "pure"])
def test_is_overridden_compares_the_functions_behind_methods(hook):
    assert not is_overridden(hook, _Same(), _Base) and not is_overridden(hook, _Same, _Base)
    assert is_overridden(hook, _Own(), _Base) and is_overridden(hook, _Own, _Base)


def test_is_overridden_with_defaults_that_lack_the_hook():
    assert not is_overridden("missing", _Own(), _Base)  # nobody has it
    assert is_overridden("hook", _Own(), object, _Same)  # object lacks it, _Same inherits _Base's: _Own's is its own
    assert not is_overridden("hook", _Own(), _Own, _Base)  # one default has exactly this one
    assert is_overridden("hook", _Base())  # no defaults: it has it


def test_a_callbacks_defined_hooks_are_its_own_not_lightnings_or_the_federated_defaults():
    class Mine(FederatedCallback):
        def on_client_end(self, trainer, pl_module, client_id):
            pass

        def on_train_batch_end(self, *args):
            pass

    hooks = ("on_client_end", "on_client_train_end", "on_train_batch_end", "on_train_batch_start")
    assert defined_hooks(Mine(), hooks) == ["on_client_end", "on_train_batch_end"]
    assert defined_hooks(Callback(), hooks) == defined_hooks(FederatedCallback(), hooks) == []


def test_algorithm_overrides_names_what_a_class_changes():
    assert not DisPFL.overrides("aggregate") and not DisPFL().overrides("local_train")
    assert DisPFL.overrides("plan_round") and FedAvg.overrides("consensus_sources") and not FedAvg.overrides("server_step")
    assert not Algorithm.overrides("aggregate")


def test_a_subclass_that_changes_a_hook_is_told_in_one_warning_which_flags_it_lost():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        class Mine(DisPFL):
            def aggregate(self, ctx, messages):
                return super().aggregate(ctx, messages)

    lost = [w for w in caught if issubclass(w.category, FlagsLostWarning)]
    assert len(lost) == 1, [str(w.message) for w in caught]
    text = str(lost[0].message)
    assert "Mine changes aggregate of DisPFL" in text
    assert "shardable = True" in text and "reads_only_sources = True" in text and "partitionable = True" in text
    assert lost[0].filename == __file__  # pointed at the class statement
    assert not Mine.declares("shardable") and not Mine.declares("reads_only_sources")


def test_restating_or_refusing_the_flags_is_silent_and_a_plain_subclass_keeps_them():
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlagsLostWarning)

        class Restated(DisPFL):
            shardable = True
            reads_only_sources = True
            partitionable = True

            def aggregate(self, ctx, messages):
                return super().aggregate(ctx, messages)

        class Refused(DisPFL):
            shardable = False
            reads_only_sources = False
            partitionable = False

            def aggregate(self, ctx, messages):
                return super().aggregate(ctx, messages)

        class Plain(DisPFL):
            def __init__(self, num_neighbors: int = 3) -> None:
                super().__init__(num_neighbors)

        class Quiet(Algorithm):  # its parent declares no flag: nothing to lose
            def plan_round(self, ctx):
                raise NotImplementedError

    assert Restated.declares("shardable") and Restated.declares("reads_only_sources")
    assert not Refused.declares("shardable") and not Refused.declares("reads_only_sources")
    assert Plain.declares("shardable") and Plain.declares("reads_only_sources")
    assert not Quiet.declares("shardable")


def test_defining_the_shipped_algorithms_warns_nothing():
    code = ("import warnings; warnings.simplefilter('error')\n"
            "from lightning_dfl.federation.algorithms import ALGORITHMS\n"
            "print(len([ALGORITHMS.get(n) for n in ALGORITHMS.names()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "17"


def test_the_public_face_imports_and_stays_light():
    code = ("import sys\n"
            "import lightning_dfl.federation.store.fields\n"
            "light = 'lightning_dfl.federation.trainer.trainer' not in sys.modules\n"
            "from lightning_dfl.federation import FederatedTrainer, Algorithm, RoundPlan, Task, Source, StateField, Clock\n"
            "from lightning_dfl.federation.trainer.trainer import FederatedTrainer as T\n"
            "from lightning_dfl.federation.store.fields import StateField as F\n"
            "print(light, FederatedTrainer is T, StateField is F, Clock.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "True", "True", "lightning_dfl.federation.loop.clock"]


def test_an_unknown_public_name_is_an_attribute_error():
    import lightning_dfl.federation as federation

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        federation.Nope  # noqa: B018


def test_a_callback_declares_its_per_client_state_as_state_fields():
    import torch

    from lightning_dfl.callbacks import PQIPruning
    from lightning_dfl.federation.store.factory import state_fields
    from lightning_dfl.state_field import StateField

    class Declares:
        def __init__(self, specs):
            self.specs = specs

        def client_state_fields(self, trainer, pl_module):
            return self.specs

    assert [f.name for f in PQIPruning().client_state_fields(None, None)] == ["pqi/sparsity"]
    field = StateField("mine/value", dtype=torch.float64)
    got = state_fields(DisPFL(), [Declares([field, {"name": "mine/count", "dtype": torch.int64}])], None, None)
    assert got == [field, StateField("mine/count", dtype=torch.int64)]  # a dict of its arguments is read as one
    with pytest.raises(TypeError, match=r"Declares.client_state_fields returned 'mine/value' \(str\); allowed: "
                                        r"StateField"):
        state_fields(DisPFL(), [Declares(["mine/value"])], None, None)
