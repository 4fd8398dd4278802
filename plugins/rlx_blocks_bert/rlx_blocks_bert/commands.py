"""`rlx similarity MODEL QUERY TEXT...`: rank texts by how close their sentence embeddings are
to the query's (cosine similarity), the everyday use of a sentence-embedding model such as
`minilm` — registered through `rlx_register_commands`."""
from __future__ import annotations

import json

import click

from rlx_core.ir.errors import ModelError
from rlx_core.plugins import hookimpl


def rank(model, query: str, texts: list, batch_size: int = 32) -> list:
    """[(cosine similarity, index, text)] of `texts` against `query`, most similar first.
    `model` is an Encoder, a path or a packaged name."""
    import rlx_core
    from rlx_core.runtime.encoder import Encoder

    enc = model if isinstance(model, Encoder) else rlx_core.load(str(model), progress=False)
    if not isinstance(enc, Encoder):
        raise ModelError(f"{model}: a {enc.config.get('model_type', type(enc).__name__)} model is not a "
                         "text encoder; rlx similarity needs a sentence-embedding model")
    if not texts:
        raise ModelError("nothing to rank: give one or more TEXTs, or --file FILE (one text per line)")
    emb = enc.embed([query] + list(texts), batch_size=batch_size, normalize=True)
    scores = emb[1:] @ emb[0]
    order = sorted(range(len(texts)), key=lambda i: (-float(scores[i]), i))
    return [(float(scores[i]), i, texts[i]) for i in order]


def _lines(file: str) -> list:
    try:
        with click.open_file(file, encoding="utf-8") as stream:
            return [line.rstrip("\n") for line in stream if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise ModelError(f"{file}: cannot read the texts to rank: {e}") from None


@click.command("similarity")
@click.argument("model_name", metavar="MODEL")
@click.argument("query")
@click.argument("texts", nargs=-1)
@click.option("--file", "-f", "file", metavar="FILE", default=None,
              help="Rank the non-empty lines of FILE ('-' for stdin) too.")
@click.option("--top", type=click.IntRange(1), default=None, help="Print only the N most similar.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of {score, index, text}.")
def similarity_cmd(model_name: str, query: str, texts: tuple, file: str | None, top: int | None,
                   as_json: bool) -> None:
    """Rank TEXTS (and the lines of --file) by cosine similarity to QUERY under the sentence
    embedding model MODEL (an HF folder or a packaged name such as `minilm`).

    Prints one line per text, most similar first: the score (-1 to 1) and the text.
    """
    ranked = rank(model_name, query, list(texts) + (_lines(file) if file else []))[:top]
    if as_json:
        click.echo(json.dumps([{"score": round(s, 6), "index": i, "text": t} for s, i, t in ranked]))
        return
    for score, _, text in ranked:
        click.echo(f"{score:.4f}  {text}")


@hookimpl
def rlx_register_commands(register):
    register(similarity_cmd)


__all__ = ["rank", "similarity_cmd"]
