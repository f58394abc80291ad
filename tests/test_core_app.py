"""The app's Qt-free core: storage, settings, chat and drafting controllers on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.core.chat import fit_history, regenerate_params, title_from
from app.core.controller import AppController
from app.core.drafting import apply_suggestion, plan_suggestion
from app.core.gauges import local_weight_bytes, max_local_layers
from app.core.settings import MODE_IN_PROCESS, Settings
from app.core.storage import Store
from app.core.tasks import InlineExecutor
from engine.chat import prompt_ids
from engine.errors import VeilError
from engine.generate import generate
from engine.protocol import make_invite
from engine.sampling import SamplingParams
from engine.session import RunnerOptions, open_runner
from engine.split import load_client
from tests.tiny import make_model, tiny_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "llama"
    make_model(folder, "llama", seed=3, n_layers=6)
    return folder


def make_app(tiny: Path, data: Path, k: int = 1, max_tokens: int = 12) -> AppController:
    s = Settings(
        first_run_done=True,
        mode=MODE_IN_PROCESS,
        model=str(tiny),
        local_layers=k,
        max_tokens=max_tokens,
        system_prompt="",
        repetition_penalty=1.0,  # replies are compared with the engine's plain greedy run
    )
    app = AppController(InlineExecutor(), data, settings=s)
    app.save_settings()
    app.load_config()
    return app


def greedy(tiny: Path, history: list[dict[str, str]], k: int, n: int) -> str:
    runner = open_runner(RunnerOptions(model=str(tiny), local_layers=k))
    ids = prompt_ids(runner.client.tokenizer, history)
    return generate(runner, ids, SamplingParams(max_new_tokens=n)).text


def test_store_roundtrip(tmp_path: Path) -> None:
    st = Store.open(tmp_path)
    c = st.create_conversation("A", "sys")
    m = st.add_message(c, "user", "hello 100%_")
    st.update_message(m.id, "hello 100%_ again", "eos", {"x": 1})
    st.set("k", {"a": [1, 2]})
    st.close()
    st = Store.open(tmp_path)
    assert st.get("k") == {"a": [1, 2]}
    (msg,) = st.messages(c)
    assert (msg.content, msg.finish_reason, msg.stats) == ("hello 100%_ again", "eos", {"x": 1})
    assert [x.id for x in st.conversations("100%_")] == [c]
    assert st.conversations("nothing like this") == []
    st.delete_conversation(c)
    assert st.conversations() == [] and st.messages(c) == []


def test_settings_validate_and_damaged_value(tmp_path: Path) -> None:
    st = Store.open(tmp_path)
    with pytest.raises(VeilError, match="invite"):
        Settings(mode="server").validate()
    with pytest.raises(VeilError, match="top-p"):
        Settings(top_p=0).validate()
    st.set("settings", {"theme": "purple", "font_size": 12})
    assert Settings.load(st).theme == "system"  # damaged -> defaults
    Settings(theme="dark", font_size=13).save(st)
    assert (Settings.load(st).theme, Settings.load(st).font_size) == ("dark", 13)


def test_memory_for_k_matches_the_loaded_client(tiny: Path) -> None:
    from engine.loading import load_config

    cfg = load_config(tiny)
    assert max_local_layers(cfg) == 3
    for k in (1, 3):
        client = load_client(str(tiny), k)
        assert local_weight_bytes(cfg, k) == client.local_param_bytes()


def test_chat_reply_equals_engine_greedy_and_persists(tiny: Path, tmp_path: Path) -> None:
    app = make_app(tiny, tmp_path)
    streamed: list[str] = []
    app.chat.message_updated.connect(lambda m: streamed.append(m.content))
    assert app.chat.send("The quick brown fox")
    msgs = app.chat.messages()
    assert [m.role for m in msgs] == ["user", "assistant"]
    want = greedy(tiny, [{"role": "user", "content": "The quick brown fox"}], 1, 12)
    assert msgs[1].content == want and want
    assert len(streamed) > 2  # streamed in pieces, not at once
    assert msgs[1].finish_reason in ("eos", "length")
    conv = app.chat.current
    assert app.gauge_state.tokens_per_s is not None
    app.close()
    again = AppController(InlineExecutor(), tmp_path)
    again.chat.restore_last()
    assert again.chat.current == conv
    assert [m.content for m in again.chat.messages()] == ["The quick brown fox", want]
    assert again.settings.model == str(tiny)
    md = again.chat.export_markdown(conv)
    assert "**You:**" in md and want in md
    data = json.loads(again.chat.export_json(conv))
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    again.close()


def test_stop_regenerate_and_edit(tiny: Path, tmp_path: Path) -> None:
    app = make_app(tiny, tmp_path, max_tokens=40)
    pieces: list[str] = []

    def stop_after_three(m: object) -> None:
        pieces.append("x")
        if len(pieces) == 3:
            app.chat.stop()

    app.chat.message_updated.connect(stop_after_three)
    app.chat.send("Veil splits a language model")
    reply = app.chat.messages()[-1]
    assert reply.finish_reason == "cancelled"
    app.chat.message_updated.disconnect(stop_after_three)
    app.chat.new_seed = lambda: 21
    assert app.chat.regenerate()
    msgs = app.chat.messages()
    assert len(msgs) == 2
    # Regenerate samples with a fresh seed (a greedy chat would write the same reply again)
    runner = open_runner(RunnerOptions(model=str(tiny), local_layers=1))
    ids = prompt_ids(
        runner.client.tokenizer, [{"role": "user", "content": "Veil splits a language model"}]
    )
    params = regenerate_params(SamplingParams(max_new_tokens=40), 21)
    assert msgs[1].content == generate(runner, ids, params).text
    assert app.chat.edit_last("Jane Doe lives")
    msgs = app.chat.messages()
    assert msgs[0].content == "Jane Doe lives" and len(msgs) == 2
    app.close()


def test_resplit_keeps_conversation_and_is_exact(tiny: Path, tmp_path: Path) -> None:
    app = make_app(tiny, tmp_path, k=1)
    app.chat.send("hello")
    first = app.chat.messages()[-1].content
    assert app.host.applied_k == 1
    app.set_local_layers(2)
    app.chat.send("The quick brown fox")
    assert app.host.applied_k == 2
    assert app.host.runner is not None and app.host.runner.trunk is not None
    assert (app.host.runner.trunk.start, app.host.runner.trunk.end) == (2, 4)
    history = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "The quick brown fox"},
    ]
    assert app.chat.messages()[-1].content == greedy(tiny, history, 2, 12)
    app.set_local_layers(3)  # fully local: no trunk at all
    app.chat.send("again")
    assert app.host.runner.trunk is None and app.host.state == "Fully on this computer"
    assert len(app.chat.messages()) == 6
    app.close()


def test_failed_send_gives_the_text_back(tiny: Path, tmp_path: Path) -> None:
    app = make_app(tiny, tmp_path)
    app.settings.model = str(tmp_path / "missing")
    app.host.model = app.settings.model
    app.host.config = None
    errors: list[tuple[VeilError, str]] = []
    app.chat.failed.connect(lambda e, t: errors.append((e, t)))
    app.chat.send("keep this text")
    assert len(errors) == 1 and errors[0][1] == "keep this text"
    assert "not found" in str(errors[0][0]) or "missing" in str(errors[0][0])
    assert app.chat.messages() == []
    assert app.chat.draft() == "keep this text"
    app.close()


def test_drafting_plan_and_apply() -> None:
    doc = "Intro. make this formal please. End."
    s = plan_suggestion("formal", doc, 7, 31, 0)
    assert s.source == "make this formal please." and (s.start, s.end) == (7, 31)
    s.text = "  Kindly formalise this.\n"
    assert apply_suggestion(doc, s) == "Intro. Kindly formalise this. End."
    c = plan_suggestion("continue", doc, 5, 5, 5)
    c.text = "More"
    assert apply_suggestion(doc, c) == "Intro More. make this formal please. End."
    whole = plan_suggestion("grammar", doc, 3, 3, 3)
    assert (whole.start, whole.end) == (0, len(doc))
    with pytest.raises(VeilError, match="no text"):
        plan_suggestion("summarize", "   ", 0, 0, 0)
    with pytest.raises(VeilError, match="instruction"):
        plan_suggestion("custom", doc, 0, 4, 0, custom="  ")


def test_drafting_controller_accept_reject(tiny: Path, tmp_path: Path) -> None:
    app = make_app(tiny, tmp_path)
    d = app.drafting
    d.new_document("Memo", "Dear team, the fox is quick. Thanks.")
    doc = app.store.document(d.current).body  # type: ignore[union-attr]
    s = d.request("formal", doc, 11, 28, 11)
    assert s is not None and s.done and s.text
    new = d.accept(doc)
    assert new.startswith("Dear team, ") and new.endswith(" Thanks.")
    assert new[11 : len(new) - 8].strip() == s.text.strip()
    d.request("grammar", doc, 0, 4, 0)
    d.reject()
    assert d.suggestion is None
    with pytest.raises(VeilError):
        d.accept(doc)
    out = tmp_path / "memo.md"
    d.export(d.current, out)  # type: ignore[arg-type]
    assert out.read_text().startswith("# Memo\n\nDear team")
    with pytest.raises(VeilError, match="cannot export"):
        d.export(d.current, tmp_path / "memo.pdf")  # type: ignore[arg-type]
    app.close()


def test_fit_history_and_title() -> None:
    tok = tiny_tokenizer()
    msgs = [{"role": "system", "content": "s"}] + [
        {"role": "user", "content": "word " * 50} for _ in range(4)
    ]
    full = len(prompt_ids(tok, msgs))
    ids = fit_history(tok, msgs, full - 10)
    assert len(ids) < full - 10
    with pytest.raises(VeilError, match="too long"):
        fit_history(tok, msgs, 5)
    assert title_from("a  b\nc") == "a b c" and len(title_from("x" * 100)) == 40


def test_conversation_list_ops_and_first_run_choice(tiny: Path, tmp_path: Path) -> None:
    app = make_app(tiny, tmp_path)
    a = app.chat.new_conversation()
    app.chat.send("invoice numbers")
    b = app.chat.new_conversation()
    app.chat.rename(b, "Budget")
    with pytest.raises(VeilError, match="name"):
        app.chat.rename(b, "  ")
    assert [c.id for c in app.store.conversations("invoice")] == [a]
    assert [c.id for c in app.store.conversations("budg")] == [b]
    app.chat.delete(b)
    assert app.chat.current is None and [c.id for c in app.store.conversations()] == [a]
    with pytest.raises(VeilError, match="invite"):
        app.choose_server("   ")
    with pytest.raises(VeilError, match="damaged"):  # refused before anything changes
        app.choose_server(" veil1:abc ")
    assert app.settings.mode == MODE_IN_PROCESS and Settings.load(app.store).invite == ""
    code = make_invite("tcp://10.0.0.7:5757", "x" * 40)
    app.choose_server(f" {code} ")
    assert Settings.load(app.store).invite == code
    assert (app.host.mode, app.host.invite) == ("server", code)
    app.choose_demo()
    assert Settings.load(app.store).mode == "demo" and Settings.load(app.store).first_run_done
    app.close()


def test_audit_figure_from_the_latest_stored_audit(tiny: Path, tmp_path: Path) -> None:
    from app.core import audit_info
    from engine.audit.store import save_results

    app = make_app(tiny, tmp_path)  # points VEIL_DATA_DIR at tmp_path
    name = app.model_name()
    assert app.audit_figure(1).value == "not audited yet"
    rows = [
        {"k": 1, "attack": "mlp", "side": "input", "top1": 0.42, "top1_ci": [0.4, 0.44]},
        {"k": 1, "attack": "logit_lens", "side": "output", "top1": 0.61, "top1_ci": [0.6, 0.62]},
        {"k": 2, "attack": "mlp", "side": "input", "top1": 0.05, "top1_ci": [0.04, 0.06]},
    ]
    save_results({"model": name, "date": "2026-12-01T10:00:00+00:00", "results": rows})
    f1, f2, f3 = app.audit_figure(1), app.audit_figure(2), app.audit_figure(3)
    assert (f1.value, f1.attack, f1.date) == ("61%", "logit_lens (output)", "2026-12-01")
    assert "2026-12-01" in f1.caption
    assert f2.value == "5%"
    assert f3.top1 is None and "not measured" in f3.caption
    assert [r["k"] for r in audit_info.rows(name)] == [1, 1, 2]
    assert audit_info.audit_depths(30, 12) == [1, 2, 3, 4, 6, 8, 12]
    app.close()


def test_markdown_segments_split_code_blocks_even_while_streaming() -> None:
    from app.core.markdown import Segment, segments

    text = "Here:\n```python\ndef f():\n    return 1\n```\nDone."
    assert segments(text) == [
        Segment("text", "Here:"),
        Segment("code", "def f():\n    return 1", "python"),
        Segment("text", "Done."),
    ]
    assert segments("Start\n```js\nlet x") == [
        Segment("text", "Start"),
        Segment("code", "let x", "js"),
    ]
    assert segments("") == []


def test_default_model_shows_the_shipped_audit_until_the_user_runs_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A fresh install shows the team's measured audit of the default model at the slider."""
    from app.core import audit_info
    from engine.audit.store import save_results, worst_case
    from engine.loading import DEFAULT_MODEL

    monkeypatch.setenv("VEIL_DATA_DIR", str(tmp_path / "fresh"))
    shipped = json.loads(audit_info.shipped_audit_path(DEFAULT_MODEL).read_text())
    fig = audit_info.figure(DEFAULT_MODEL, 2)
    assert fig.top1 == worst_case(shipped, 2)[0]  # type: ignore[index]
    assert fig.date == shipped["date"][:10]
    own = {
        **shipped,
        "date": "2030-01-01",
        "results": [{"k": 2, "attack": "ridge", "side": "input", "top1": 0.5}],
    }
    save_results(own)
    assert audit_info.figure(DEFAULT_MODEL, 2).top1 == 0.5  # the user's own audit wins
    assert audit_info.figure("some-other-model", 2).top1 is None


def test_privacy_words_never_contradict_the_split() -> None:
    """Fully local (k >= L/2) always reads "None" with no figure; otherwise one word and one
    sentence follow the audit's worst case, and the welcome text repeats the same sentence."""
    from app.core.audit_info import AuditFigure
    from app.core.privacy import describe, fully_local, welcome_text

    assert [k for k in range(1, 16) if fully_local(30, k)] == [15]
    assert [k for k in range(1, 4) if fully_local(5, k)] == [3]
    old = AuditFigure(15, 0.87, "mlp (input)", "2026-12-01")  # an old audit measured k=15
    v = describe(30, 15, old)
    assert (v.level, v.local, v.audited) == ("None", True, False)
    assert "%" not in v.figure + v.caption and "87" not in v.figure + v.caption
    assert "nothing you type is sent" in welcome_text(v)
    for top1, word in ((0.994, "High"), (0.3, "Medium"), (0.02, "Low")):
        v = describe(30, 2, AuditFigure(2, top1, "known_weights (input)", "2026-12-02"))
        assert v.level == word and v.sentence and "2026-12-02" in v.caption
        assert v.sentence[1:] in welcome_text(v)
    v = describe(30, 5, AuditFigure(5, None, "", "2026-12-02"))
    assert v.level == "Unknown" and "%" not in v.figure and "not been audited" in v.sentence
    assert describe(None, 2, None).level == "Unknown"  # still loading: no claim either way


def test_audit_depths_time_estimate_and_wording() -> None:
    from app.core import audit_info as ai

    assert ai.audit_depths(30, 15) == [1, 2, 3, 4, 6, 8]  # nothing is sent at 15
    assert ai.audit_depths(30, 14) == [1, 2, 3, 4, 6, 8, 14]
    assert ai.audit_depths(6, 3) == [1, 2] and ai.audit_depths(2, 1) == []
    ks = [1, 2, 3]
    base = ai.estimate_seconds(ks, 135e6)
    assert ai.estimate_seconds(ks, 270e6) == pytest.approx(2 * base)
    assert ai.estimate_seconds(ks, 135e6, (100.0, ks)) == pytest.approx(100.0)  # this machine
    assert ai.estimate_seconds([1, 2, 3, 4], 135e6, (100.0, ks)) > 100.0
    assert ai.human_duration(44) == "about 40 seconds"
    assert ai.human_duration(250) == "about 4 minutes"
    assert ai.human_duration(4000) == "about 1 hour 7 minutes"
    assert ai.elapsed_text(222) == "3 min 42 s" and ai.elapsed_text(9.6) == "10 s"


def test_problem_causes_and_reconnect_promise() -> None:
    from app.core import problems as P
    from app.core.engine_host import CONNECTED, NEEDS_SETUP, OFFLINE
    from engine.errors import AuthError, ModelSpecError, TransportError

    lost = TransportError("no answer from the server", hint="is it running?")
    assert P.cause_of(lost, OFFLINE) == P.CONNECTION
    assert P.explain(lost, OFFLINE).hint == "is it running? " + P.RECONNECTS
    bad_invite = VeilError("the invite code is damaged")
    assert P.cause_of(bad_invite, NEEDS_SETUP) == P.INVITE
    assert P.explain(bad_invite, NEEDS_SETUP) is bad_invite  # never "reconnects by itself"
    assert P.cause_of(ModelSpecError("no such model"), CONNECTED) == P.MODEL
    assert P.cause_of(AuthError("key refused"), OFFLINE) == P.SETTINGS
    restarting = TransportError("the built-in server stopped", hint="Veil is restarting it")
    assert P.explain(restarting, OFFLINE) is restarting  # says it already
    assert P.cause_of(VeilError("boom"), CONNECTED) == P.REPLY


def test_invite_checks_and_damaged_stored_invite(tmp_path: Path) -> None:
    from app.core.invite import invite_address, invite_problem

    good = make_invite("tcp://10.0.0.7:5757", "k" * 40)
    assert invite_problem(good) is None and invite_address(good) == "tcp://10.0.0.7:5757"
    assert invite_problem("veil1:abc") == "the invite code is damaged"
    assert "veil1:" in (invite_problem("hello") or "")
    assert invite_problem("  ") and invite_address("veil1:abc") == ""
    with pytest.raises(VeilError, match="damaged"):
        Settings(mode="server", invite="veil1:abc").validate()
    st = Store.open(tmp_path)
    Settings(mode="server", invite="veil1:abc", theme="dark", font_size=14).save(st)
    s = Settings.load(st)  # the other settings survive; connecting reports the code
    assert (s.invite, s.theme, s.font_size) == ("veil1:abc", "dark", 14)
    st.close()


def test_line_breaks_chart_runs_and_continue(tiny: Path, tmp_path: Path) -> None:
    from app.core.gauges import GaugeState
    from app.core.markdown import keep_line_breaks

    sig = "Kind regards,\nSam Patel\nOffice Manager"
    assert keep_line_breaks(sig) == "Kind regards,\\\nSam Patel\\\nOffice Manager"
    lists = "Items:\n- one\n- two\n\n1. a\n2. b"
    assert keep_line_breaks(lists) == "Items:\n- one\n- two\n\n1. a\n2. b"

    g = GaugeState()
    g.begin_run()
    g.record(10.0, now=100.0)
    g.record(11.0, now=100.3)
    g.begin_run()  # 20 s idle, then the next reply
    g.record(9.0, now=120.0)
    runs = g.last_minute_runs(now=121.0)
    assert [len(r) for r in runs] == [2, 1] and runs[1][0] == (1.0, 9.0)

    app = make_app(tiny, tmp_path, max_tokens=4)
    assert app.chat.send("The quick brown fox")
    first = app.chat.messages()[-1]
    assert first.finish_reason == "length" and app.chat.can_continue()
    assert app.chat.continue_reply()
    msgs = app.chat.messages()
    assert len(msgs) == 2 and msgs[-1].id == first.id
    assert msgs[-1].content.startswith(first.content) and len(msgs[-1].content) > len(first.content)
    app.chat.send("again")
    assert app.chat.can_continue() == (app.chat.messages()[-1].finish_reason == "length")
    app.close()
