"""hacpo compare's table and plot with one seed, found by using it: a cell of one seed has no
95% interval, and the table and plot say so instead of showing the mean as if it had one (a
bare "50.0" under "mean ± 95% CI", an error bar of 0)."""
from hacpo.engine.compare import plot_compare, render_table

ONE = {"gspo": {"a": [{"seed": 0, "accuracy": 0.5, "before": 0.25}]}}
TWO = {"gspo": {"a": [{"seed": 0, "accuracy": 0.5, "before": 0.25},
                      {"seed": 1, "accuracy": 0.75, "before": 0.25}]}}


def test_the_table_says_one_seed_has_no_interval():
    note = "One seed: no interval (undefined), its mean alone."
    one = render_table(ONE, 0).splitlines()
    assert one[2] == "| gspo | 50.0 | 1 |" and one[-1].endswith("a 25.0. " + note)
    assert note not in render_table(TWO, 0)


def test_the_plot_says_one_seed_has_no_interval(tmp_path, monkeypatch):
    import hacpo.engine.compare as compare_mod
    axes = []
    real = compare_mod.subplots

    def kept(*a, **k):
        fig, ax = real(*a, **k)
        axes.append(ax)
        return fig, ax
    monkeypatch.setattr(compare_mod, "subplots", kept)
    for results in (ONE, TWO):
        plot_compare(results, str(tmp_path / "compare.png"))
    assert [ax.get_title() for ax in axes] == [
        "hacpo compare: mean ± 95% CI over seeds (one seed: no interval)",
        "hacpo compare: mean ± 95% CI over seeds"]
