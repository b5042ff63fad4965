"""The results page `architectures`: every MoE family of the installed transformers, checked."""

from __future__ import annotations

from experiments.report_tables import Headline, Page, Rows, Table, load


def page() -> Page:
    def rows() -> Rows:
        d = load("archs.json")
        esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
        return ["family", "offloaded generation", "detail", "trace, train, evaluate, serve SiDA", "CGOPipe"], [
            [f"`{r['family']}`", r["status"], esc(r["detail"]), esc(r.get("pipeline") or "—"), esc(r.get("cgopipe") or "—")]
            for r in d["rows"]]

    d = load("archs.json")
    return Page("architectures", "Supported architectures", f"""
Every MoE architecture of the installed transformers ({d['transformers']}) is built tiny and checked:
offloaded generation must give the plain model's greedy tokens, or the family is refused in one line
with the reason. Conclude that offloading, tracing and SiDA serving work for nearly every MoE
family transformers ships, and that CGOPipe batch decoding is narrower: it drives only decoder-only
models built like Mixtral. {d['summary']}
""", (Table("Every MoE family", ("archs.json",), f"{d['command']} --markdown --json results/archs.json", rows),))


HEADLINES: tuple[Headline, ...] = (
    Headline("MoE architectures of transformers offloaded exactly",
             lambda: (lambda rows: f"{sum(r['status'] == 'exact' for r in rows)} of {len(rows)}")(load("archs.json")["rows"]),
             "architectures", "archs.json"),
)
