"""Issue 34, files in and out (no Qt, no model): extraction with page and paragraph numbers,
matters indexed with FTS5 and queried with the right [file, page], re-indexing, per-matter
separation, the passages that fit a prompt, and Word export read back."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from app.core.documents import extract as ex
from app.core.documents.context import (
    Source,
    block,
    count_tokens,
    fit_sources,
    prompt_with_sources,
    select_sources,
    used_text,
    with_sources,
)
from app.core.documents.index import DocIndex, Hit, fts5_available, match_query
from app.core.documents.word import document_docx, markdown_to_docx, new_document, word_friendly
from tests.doc_files import (
    CLAUSE,
    CLAUSE_FILE,
    CLAUSE_PAGE,
    make_docx,
    make_matter,
    make_odt,
    make_pdf,
    make_scanned_pdf,
)
from tests.tiny import tiny_tokenizer

PAGES = [
    ["Lease agreement between Alpha Ltd and Beta LLC.", "Clause 1: the term is two years."],
    ["Clause 2: the monthly rent is 1,200 euros.", "Clause 3: the deposit is three months."],
    ["Clause 4: either party may terminate with ninety days notice."],
]


def test_pdf_text_pages_and_paragraphs(tmp_path: Path) -> None:
    doc = ex.extract(make_pdf(tmp_path / "lease.pdf", PAGES))
    assert doc.kind == "PDF" and doc.pages == 3
    got = [(p.page, p.para, p.text) for p in doc.passages]
    # pypdf keeps the text in reading order and on its own page; reportlab's paragraph
    # spacing is not a blank line, so a page's wrapped lines come back as one passage
    assert [g[0] for g in got] == [1, 2, 3]
    for page, (_, _, text) in zip(PAGES, got, strict=True):
        assert text == " ".join(page)


def test_pdf_long_page_keeps_order_and_joins_hyphens(tmp_path: Path) -> None:
    long = [f"word{i} " + "continues " * 30 for i in range(6)]
    doc = ex.extract(make_pdf(tmp_path / "long.pdf", [long, ["second page"]]))
    text = doc.passages[0].text
    positions = [text.index(f"word{i} ") for i in range(6)]
    assert positions == sorted(positions)
    assert doc.passages[-1].page == 2 and doc.passages[-1].text == "second page"
    assert ex._pdf_page_paragraphs("termi-\nnate the\nlease\n\nnext") == [
        "terminate the lease",
        "next",
    ]


def test_scanned_pdf_is_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(ex.DocumentError, match="scanned PDF") as err:
        ex.extract(make_scanned_pdf(tmp_path / "scan.pdf"))
    assert "OCR" not in str(err.value) or "text recognition" in str(err.value)


def test_docx_pages_from_page_breaks_and_tables(tmp_path: Path) -> None:
    doc = ex.extract(make_docx(tmp_path / "lease.docx", PAGES))
    assert doc.kind == "Word" and doc.pages == 3
    assert [(p.page, p.para) for p in doc.passages] == [(1, 1), (1, 2), (2, 3), (2, 4), (3, 5)]
    assert doc.passages[2].text == PAGES[1][0]
    import docx

    d = docx.Document()
    d.add_paragraph("Before the table.")
    t = d.add_table(rows=2, cols=2)
    t.cell(0, 0).text, t.cell(0, 1).text = "Item", "Amount"
    t.cell(1, 0).text, t.cell(1, 1).text = "Deposit", "3,600 EUR"
    d.add_paragraph("After the table.")
    d.save(str(tmp_path / "t.docx"))
    doc = ex.extract(tmp_path / "t.docx")
    assert [p.text for p in doc.passages] == [
        "Before the table.",
        "Item | Amount",
        "Deposit | 3,600 EUR",
        "After the table.",
    ]
    assert all(p.page is None for p in doc.passages)  # no page breaks stored: paragraphs


def test_text_markdown_and_odt(tmp_path: Path) -> None:
    (tmp_path / "n.md").write_text("# Notes\n\nFirst para\nstill first.\n\nSecond.\f\nThird.\n")
    doc = ex.extract(tmp_path / "n.md")
    assert [(p.page, p.para, p.text) for p in doc.passages] == [
        (1, 1, "# Notes"),
        (1, 2, "First para\nstill first."),
        (1, 3, "Second."),
        (2, 4, "Third."),
    ]
    (tmp_path / "w.txt").write_bytes("Caf\xe9 cr\xe8me".encode("cp1252"))
    assert ex.extract(tmp_path / "w.txt").passages[0].text == "Café crème"
    doc = ex.extract(make_odt(tmp_path / "o.odt", ["Héllo <text:s text:c='2'/>there", "Two"]))
    assert [p.text for p in doc.passages] == ["Héllo there", "Two"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("a.doc", b"x", "not a supported kind"),
        ("a.pdf", b"not a pdf at all", "not a readable PDF"),
        ("a.docx", b"not a zip", "not a Word"),
        ("a.odt", b"nope", "not an OpenDocument"),
        ("a.txt", b"   \n\n ", "contains no text"),
    ],
)
def test_bad_files_give_one_line(tmp_path: Path, name: str, content: bytes, message: str) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ex.DocumentError, match=message) as err:
        ex.extract(tmp_path / name)
    assert "\n" not in str(err.value) and name in str(err.value)
    with pytest.raises(ex.DocumentError, match="not there"):
        ex.extract(tmp_path / "missing.pdf")


def test_encrypted_pdf(tmp_path: Path) -> None:
    from pypdf import PdfReader, PdfWriter

    make_pdf(tmp_path / "p.pdf", PAGES)
    w = PdfWriter()
    for page in PdfReader(str(tmp_path / "p.pdf")).pages:
        w.add_page(page)
    w.encrypt("secret")
    with open(tmp_path / "locked.pdf", "wb") as f:
        w.write(f)
    with pytest.raises(ex.DocumentError, match="password"):
        ex.extract(tmp_path / "locked.pdf")


def test_fts5_present_and_queries_are_safe() -> None:
    assert fts5_available()
    q = match_query('What does "force majeure" say? AND NOT NEAR(x* y')
    assert q == '"force" OR "majeure" OR "near" OR "force majeure" OR "majeure near"'
    import sqlite3

    con = sqlite3.connect(":memory:")
    con.execute("CREATE VIRTUAL TABLE t USING fts5(x)")
    con.execute("INSERT INTO t VALUES ('force majeure applies')")
    assert con.execute("SELECT count(*) FROM t WHERE t MATCH ?", (q,)).fetchone() == (1,)
    assert match_query("what is it?") == ""


@pytest.fixture(scope="module")
def matter_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_matter(tmp_path_factory.mktemp("matter") / "Smith v Jones")


def test_matter_of_50_files_cites_the_right_file_and_page(
    matter_folder: Path, tmp_path: Path
) -> None:
    index = DocIndex.open(tmp_path)
    m = index.create_matter("Smith v Jones")
    index.add_paths(m, [matter_folder])
    steps: list[float] = []
    report = index.sync(m, lambda _s, f: steps.append(f))
    assert len(report.added) == 50 and not report.failed
    assert steps == sorted(steps) and steps[-1] == 1.0
    hits = index.search(m, "What does the force majeure clause say about notifying?")
    top = hits[0]
    assert (top.name, top.page) == (CLAUSE_FILE, CLAUSE_PAGE)
    assert CLAUSE in top.text
    sources = select_sources(index, m, "force majeure", tiny_tokenizer(), 400)
    assert sources[0].label() == f"{CLAUSE_FILE}, p. {CLAUSE_PAGE}"
    assert sources[0].n == 1
    # the database holds the files' text: private to the user
    if os.name == "posix":
        assert (tmp_path / "documents.sqlite3").stat().st_mode & 0o777 == 0o600


def test_reindex_on_change_add_and_delete(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    make_pdf(folder / "a.pdf", [["alpha clause one"], ["indemnity clause two"]])
    (folder / "b.txt").write_text("nothing here about it")
    index = DocIndex.open(tmp_path)
    m = index.create_matter("M")
    index.add_paths(m, [folder])
    assert sorted(index.sync(m).added) == ["a.pdf", "b.txt"]
    assert [(h.name, h.page) for h in index.search(m, "indemnity")] == [("a.pdf", 2)]
    again = index.sync(m)
    assert not again.changed  # nothing changed: nothing read again
    (folder / "b.txt").write_text("the indemnity cap is one million")
    st = (folder / "b.txt").stat()
    os.utime(folder / "b.txt", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    report = index.sync(m)
    assert report.updated == ["b.txt"] and not report.added
    assert {h.name for h in index.search(m, "indemnity")} == {"a.pdf", "b.txt"}
    (folder / "a.pdf").unlink()
    assert index.sync(m).removed == ["a.pdf"]
    assert [h.name for h in index.search(m, "indemnity")] == ["b.txt"]
    (folder / "c.doc").write_text("old word file")  # unsupported in a folder: left out
    (folder / "~$b.docx").write_text("word lock file")
    assert not index.sync(m).changed
    (folder / "d.pdf").write_bytes(b"broken")
    report = index.sync(m)
    assert [n for n, _ in report.failed] == ["d.pdf"]
    assert next(f for f in index.files(m) if f.name == "d.pdf").error
    assert not index.sync(m).failed  # not retried until the file changes


def test_matters_are_separate(tmp_path: Path) -> None:
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    (a_dir / "a.txt").write_text("The arbitration seat is Geneva.")
    (b_dir / "b.txt").write_text("The arbitration seat is London.")
    index = DocIndex.open(tmp_path)
    a, b = index.create_matter("A"), index.create_matter("B")
    index.add_paths(a, [a_dir])
    index.add_paths(b, [b_dir])
    index.sync(a)
    index.sync(b)
    assert [h.name for h in index.search(a, "arbitration seat")] == ["a.txt"]
    assert [h.name for h in index.search(b, "arbitration seat")] == ["b.txt"]
    assert [h.name for h in index.in_order(a)] == ["a.txt"]
    msgs, used = with_sources(
        index, a, [{"role": "user", "content": "arbitration seat?"}], tiny_tokenizer(), 400
    )
    assert "Geneva" in msgs[-1]["content"] and "London" not in msgs[-1]["content"]
    assert [s["path"] if isinstance(s, dict) else s.path for s in used] == [str(a_dir / "a.txt")]
    # the same file in two matters is two entries; deleting one matter leaves the other
    index.add_paths(b, [a_dir / "a.txt"])
    index.sync(b)
    index.delete_matter(a)
    assert [h.name for h in index.search(b, "Geneva")] == ["a.txt"]
    assert index.chunk_count(a) == 0


def test_chat_links_and_deleted_chats(tmp_path: Path) -> None:
    index = DocIndex.open(tmp_path)
    (tmp_path / "x.txt").write_text("text")
    own = index.chat_matter(7)
    assert index.chat_matter(7) == own and index.matters() == []  # not listed as a matter
    index.add_paths(own, [tmp_path / "x.txt"])
    index.sync(own)
    named = index.create_matter("Named")
    index.link_chat(7, named)  # moving the chat into a matter drops its own files' text
    assert index.matter(own) is None and index.chunk_count(own) == 0
    index.link_chat(8, named)
    index.forget_chats(lambda conv: conv == 8)
    assert index.matter_of_chat(7) is None and index.matter_of_chat(8) == named


def test_sources_fit_the_budget(tmp_path: Path) -> None:
    tok = tiny_tokenizer()
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "small.txt").write_text("Short note: rent due on the first.")
    index = DocIndex.open(tmp_path)
    m = index.create_matter("M")
    index.add_paths(m, [folder])
    index.sync(m)
    # everything fits: the whole matter goes in, whatever the question
    assert [s.name for s in select_sources(index, m, "summarize", tok, 300)] == ["small.txt"]
    assert select_sources(index, m, "summarize", tok, 10) == []  # no room: none
    big = [Hit(1, 1, "/x/big.pdf", 1, 1, 0, "word " * 400), Hit(2, 1, "/x/big.pdf", 2, 1, 1, "x")]
    fitted = fit_sources(big, tok, 120)
    assert len(fitted) == 1 and fitted[0].text.endswith("…")  # the best one, shortened
    assert count_tokens(tok, block(fitted[0])) <= 120
    assert prompt_with_sources("q?", fitted).endswith("…\n\nQuestion: q?")
    assert used_text([{"path": "a"}, {"path": "a"}, {"path": "b"}], 5) == (
        "Used 3 passages from 2 files (of 5)"
    )
    assert Source(1, "/d/n.txt", None, 4, "t").label() == "n.txt, ¶ 4"


def test_attach_30_page_pdf_and_10_page_docx(tmp_path: Path) -> None:
    """Acceptance: both read and indexed with progress (the time is printed, not asserted)."""
    pages = [
        [f"Page {p} clause {q}: " + "the tenant pays the rent monthly. " * 12 for q in range(4)]
        for p in range(1, 31)
    ]
    make_pdf(tmp_path / "long.pdf", pages)
    make_docx(tmp_path / "long.docx", pages[:10])
    index = DocIndex.open(tmp_path)
    m = index.create_matter("M")
    index.add_paths(m, [tmp_path / "long.pdf", tmp_path / "long.docx"])
    seen: list[str] = []
    t0 = time.perf_counter()
    report = index.sync(m, lambda s, _f: seen.append(s))
    took = time.perf_counter() - t0
    print(f"30-page PDF + 10-page DOCX indexed in {took:.2f} s")
    assert sorted(report.added) == ["long.docx", "long.pdf"]
    assert any("reading long.pdf" in s for s in seen)
    files = {f.name: f for f in index.files(m)}
    assert files["long.pdf"].pages == 30 and files["long.docx"].pages == 10
    hit = index.search(m, "Page 27 clause 2")[0]
    assert (hit.name, hit.page) == ("long.pdf", 27)


def test_docx_export_read_back(tmp_path: Path) -> None:
    import docx

    md = (
        "# Summary\n\nThe **deposit** is *three* months.\n\n## Steps\n\n1. Sign\n2. Pay\n\n"
        "- keys\n- parking\n  - bay 4\n\nNext list:\n\n1. again\n\n```\ncode line\n```\n\n"
        "| Item | Amount |\n|---|---|\n| Rent | 1,200 |\n"
    )
    d = new_document("t")
    markdown_to_docx(d, md)
    d.save(str(tmp_path / "x.docx"))
    back = docx.Document(str(tmp_path / "x.docx"))
    paras = [(p.style.name, p.text) for p in back.paragraphs]
    assert paras[:2] == [("Heading 1", "Summary"), ("Normal", "The deposit is three months.")]
    assert ("Heading 2", "Steps") in paras
    assert [t for s, t in paras if s == "List Number"] == ["Sign", "Pay", "again"]
    assert [t for s, t in paras if s.startswith("List Bullet")] == ["keys", "parking", "bay 4"]
    assert ("List Bullet 2", "bay 4") in paras
    runs = back.paragraphs[1].runs
    assert [(r.text, bool(r.bold), bool(r.italic)) for r in runs] == [
        ("The ", False, False),
        ("deposit", True, False),
        (" is ", False, False),
        ("three", False, True),
        (" months.", False, False),
    ]
    code = next(p for p in back.paragraphs if p.text == "code line")
    assert code.runs[0].font.name == "Consolas"
    table = back.tables[0]
    assert [c.text for c in table.rows[1].cells] == ["Rent", "1,200"]
    assert table.rows[0].cells[0].paragraphs[0].runs[0].bold
    # each numbered list starts at 1: its own numbering instance
    nums = [p._p.pPr.numPr.numId.val for p in back.paragraphs if p.style.name == "List Number"]
    assert nums[0] == nums[1] != nums[2]


def test_document_export_docx_private_and_word_friendly(tmp_path: Path) -> None:
    import docx

    out = tmp_path / "Letter.docx"
    document_docx("Letter", "Dear Sam,\nthanks.\n\n- one\n- **two**", out)
    back = docx.Document(str(out))
    assert [(p.style.name, p.text) for p in back.paragraphs] == [
        ("Heading 1", "Letter"),
        ("Normal", "Dear Sam,\nthanks."),
        ("List Bullet", "one"),
        ("List Bullet", "two"),
    ]
    if os.name == "posix":
        assert out.stat().st_mode & 0o777 == 0o600
    assert not list(tmp_path.glob(".*.tmp"))
    document_docx("Odd", "a model wrote \x00 and \x0b here", tmp_path / "odd.docx")
    assert docx.Document(str(tmp_path / "odd.docx")).paragraphs[1].text == (
        "a model wrote \ufffd and  here"  # CommonMark turns NUL into U+FFFD
    )
    assert word_friendly("## Plan\n\n**Bold** and `code`\n\n1. a\n2. b\n\n- x\n") == (
        "Plan\n\nBold and code\n\n1. a\n2. b\n\n• x\n"
    )
