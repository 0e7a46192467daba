"""Every algorithm option is a setting or a rule option, and a run whose rule option departs from the original
method's value is labelled with it (lightning_dfl.federation.algorithms.departures)."""

import importlib
import sys
from pathlib import Path

import pytest
import yaml

from lightning_dfl.federation import ALGORITHMS
from lightning_dfl.federation.algorithms.departures import merged, options, rule_options

CONFIGS = Path(__file__).resolve().parents[1] / "configs"

#: (algorithm, option) -> the other options a departure needs to have an effect (else it is inert)
CONTEXT = {
    ("beer", "ratio"): {"compressor": "top_k"},
    ("prisam", "dbscan_eps"): {"grouping": "dbscan"},
    ("prisam", "dbscan_min_samples"): {"grouping": "dbscan"},
}
#: (algorithm, option) -> a departing value where none of the generic candidates is accepted
ALTERNATIVES = {
    ("dfedavgm", "message_dtype"): "float16",
    ("dfedsam", "message_dtype"): "float16",
    ("psfl", "kappa2_estimator"): "max",
    ("psfl", "sigma2_estimator"): "minibatch",
    ("beer", "noise"): "normal",
    ("prisam", "dbscan_eps"): 0.3,
}


def _choices(cls, default):
    """The strings of the tuples in the algorithm's module (and its bases') that hold ``default``."""
    out = []
    for base in cls.__mro__:
        module = sys.modules.get(base.__module__)
        for value in vars(module).values() if module else ():
            if isinstance(value, (tuple, dict)) and default in value and all(isinstance(v, str) for v in value):
                out += [v for v in value if v != default]
    return out


def _candidates(cls, name, default):
    if (cls.name, name) in ALTERNATIVES:
        return [ALTERNATIVES[(cls.name, name)]]
    if isinstance(default, bool):
        return [not default]
    if isinstance(default, str):
        return _choices(cls, default)
    if isinstance(default, int):
        return [default + 1, default * 2, max(default - 1, 1)]
    if isinstance(default, float):
        return [default / 2, default * 2, 0.5, 0.9, 1.0]
    if default is None:
        return [1, 2, 0.5, 5.0, "auto"]
    return []


def _departing(cls, name, reference):
    """An instance with ``name`` at a value other than its reference (in the context it needs), and the value."""
    context = CONTEXT.get((cls.name, name), {})
    for value in _candidates(cls, name, options(cls)[name] if reference is None else reference):
        if value == reference:
            continue
        try:
            return cls(**context, **{name: value}), value
        except Exception:  # noqa: BLE001 (a value the constructor refuses: try the next)
            continue
    raise AssertionError(f"{cls.name}.{name}: no departing value among the candidates is accepted; add one to "
                         "ALTERNATIVES")


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_option_is_a_setting_or_a_rule_option_and_defaults_carry_no_label(name):
    cls = ALGORITHMS.get(name)
    own = set(vars(cls).get("settings", ()))  # a base's may name options a subclass fixes
    assert own <= set(options(cls)), f"{name}: settings that are not options: {own - set(options(cls))}"
    # a class's own entries name its rule options (a base's may name options a subclass fixes: DFedSAM's rule)
    assert set(vars(cls).get("reference", {})) <= set(rule_options(cls))
    assert set(vars(cls).get("phrases", {})) <= set(options(cls))
    algorithm = cls()
    for option in rule_options(cls):
        assert hasattr(algorithm, option), f"{name} keeps option {option!r} under another attribute"
    # the default departs only where the class says so (a reference that is not its default)
    expected = [option for option, ref in rule_options(cls).items() if options(cls)[option] != ref
                and getattr(algorithm, option) != ref]
    assert len(algorithm.deviations()) == len(expected), (name, algorithm.deviations())


CASES = [(name, option) for name in ALGORITHMS.names() for option in rule_options(ALGORITHMS.get(name))]


@pytest.mark.parametrize("name,option", CASES, ids=[f"{n}.{o}" for n, o in CASES])
def test_a_departing_rule_option_is_named_in_the_label(name, option):
    cls = ALGORITHMS.get(name)
    reference = rule_options(cls)[option]
    context = CONTEXT.get((name, option), {})
    baseline = cls(**context)
    algorithm, value = _departing(cls, option, reference)
    named = set(algorithm.deviations()) - set(baseline.deviations())  # rule "da" also sets its float16 messages
    assert named and all(phrase in algorithm.label() for phrase in named), (name, option, value, named)
    shown = f"{value:g}" if isinstance(value, float) else str(value)
    phrase = merged(cls, "phrases").get(option, "{name} {value}").format(name=option, value=shown)
    assert phrase in named, (phrase, named)


def test_the_labels_of_the_issues_examples():
    """docs/baselines.md's promise, on the departures an audit found running under the plain name."""
    from lightning_dfl.federation.algorithms import DFedAvgM, DisPFL, Ditto, FedDST, FedFomo, GossipFL, SubFedAvg

    assert DFedAvgM(rule="da").label() == "dfedavgm (message_dtype float16, rule da, weighting samples)"
    assert DFedAvgM(message_dtype="float16").label() == "dfedavgm (message_dtype float16)"
    assert DFedAvgM(clip_grad_norm=10.0).label() == "dfedavgm (clip_grad_norm 10)"
    assert Ditto(weighting="samples").label() == "ditto (weighting samples)"
    assert DisPFL(regrowth="random").label() == "dispfl (regrowth random)"
    assert FedDST(schedule="code", readjust_every=5).label() == "feddst (readjust_every 5, schedule code)"
    assert FedFomo(affinity_update="normalized").label() == "fedfomo (affinity_update normalized)"
    assert SubFedAvg(target_density=0.5, prune_fraction=0.05).label() == \
        "subfedavg (prune_fraction 0.05, target_density 0.5)"
    assert GossipFL().label() == "GossipFL" and GossipFL(compress_ratio=0.01).label() == "GossipFL (ratio 0.01)"
    assert DisPFL(num_neighbors=4, topology="ring").label() == "dispfl"  # settings are not departures


def test_a_subclass_with_arguments_of_its_own_is_labelled_by_its_base_until_it_declares_them():
    """A recorder or user extension that adds undeclared arguments (stored under other names, or without a
    default) is labelled by its base's options, not refused at the end of a run; declaring them names them."""
    from lightning_dfl.federation.algorithms import DisPFL

    class Recorder(DisPFL):
        def __init__(self, sink, factor=2.0, **kwargs):
            super().__init__(**kwargs)
            self._sink, self._factor = sink, factor

    assert Recorder([], factor=3.0).label() == "dispfl"
    assert Recorder([], regrowth="random").label() == "dispfl (regrowth random)"

    class Scaled(DisPFL):
        settings = ("sink",)

        def __init__(self, sink=None, factor=2.0, **kwargs):
            super().__init__(**kwargs)
            self.sink, self.factor = sink, factor

    assert Scaled(sink=[]).label() == "dispfl" and Scaled(factor=3.0).label() == "dispfl (factor 3)"


@pytest.mark.parametrize("config", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_each_shipped_config_is_labelled_with_its_departures(config):
    """A config's algorithm label names every rule option it sets away from its reference (a config that sets
    none and no other departure is labelled with the plain title)."""
    spec = yaml.safe_load((CONFIGS / config).read_text())["trainer"]["algorithm"]
    module, _, cls_name = spec["class_path"].rpartition(".")
    cls = getattr(importlib.import_module(module), cls_name)
    given = spec.get("init_args") or {}
    algorithm = cls(**given)
    references, phrases, inert = rule_options(cls), merged(cls, "phrases"), set(algorithm.inert_options())
    expected = [phrases.get(o, "{name} {value}").format(name=o, value=f"{v:g}" if isinstance(v, float) else v)
                for o, v in given.items() if o in references and o not in inert and v != references[o]]
    assert all(phrase in algorithm.deviations() for phrase in expected), (config, algorithm.label(), expected)
    if not algorithm.deviations():
        assert algorithm.label() == (cls.title or cls.name)
