"""The bench's plots keep their legends off the data: no legend box overlaps the axes it labels."""
import pytest

pytest.importorskip("matplotlib")

from ampfused.bench import plots  # noqa: E402

PROVIDERS = ("torch-fused", "torch-foreach", "ampfused-cpu", "ampfused-cpu+keep_scaled_grads", "ampfused-cpu@split16")


def configs_rows():
    """Every provider on every config, the tallest bars at the right-most config (where the legend sat)."""
    rows = []
    for c in range(10):
        for p, provider in enumerate(PROVIDERS):
            ms = 10.0 / (1 + p * c / 3)
            rows.append(dict(sweeps="configs", status="ok", config=f"cfg-{c}", provider=provider, median_ms=ms,
                             p20_ms=0.95 * ms, p80_ms=1.05 * ms, unstable="", case="cfg on gpt2-like 4.0M",
                             hardware="test machine"))
    return rows


def test_configs_plot_legends_sit_beside_the_bars(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(plots.plt, "close", figures.append)  # keep the figure to measure it
    assert plots.plot_configs(configs_rows(), tmp_path / "configs_speedup.png")
    (fig,) = figures
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend()
        assert legend is not None
        box, axes_box = legend.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert box.x0 >= axes_box.x1, (box, axes_box)  # wholly right of the plotting area
        assert box.x1 <= fig.bbox.x1  # and inside the picture
    plots.plt.close(fig)
