"""The demo's output helpers: wrapped, speaker-grouped chunks and whole-sentence excerpts."""

from hypothesis import given
from hypothesis import strategies as st

from aip_crewai.examples.demo import WIDTH, ChunkPrinter, excerpt, speaker_of


def printed(capsys, chunks):
    printer = ChunkPrinter()
    for speaker, text in chunks:
        printer.feed(speaker, text)
    printer.close()
    return capsys.readouterr().out


def test_words_split_across_chunks_print_whole_and_a_new_speaker_starts_a_block(capsys):
    out = printed(
        capsys,
        [
            ("task", "Classify the tic"),
            ("task", "ket now."),
            ("Analyst", "Thought: done\nFinal"),
            ("Analyst", " Answer: billing"),
        ],
    )
    assert out.splitlines() == [
        "   [task]",
        "     Classify the ticket now.",
        "   [Analyst]",
        "     Thought: done",
        "     Final Answer: billing",
    ]


def test_long_text_wraps_at_the_width_without_breaking_words(capsys):
    words = [f"word{i}" for i in range(80)]
    out = printed(capsys, [("task", " ".join(words))])
    lines = out.splitlines()[1:]
    assert len(lines) > 1 and all(len(line) <= WIDTH for line in lines)
    assert " ".join(line.strip() for line in lines).split() == words


@given(st.lists(st.text(alphabet="ab \n", max_size=30), max_size=20))
def test_any_chunking_keeps_every_word_in_order(chunks):
    import io
    from contextlib import redirect_stdout

    buffer = io.StringIO()
    with redirect_stdout(buffer):
        printer = ChunkPrinter()
        for text in chunks:
            printer.feed("s", text)
        printer.close()
    printed_words = [w for line in buffer.getvalue().splitlines()[1:] for w in line.split()]
    assert printed_words == "".join(chunks).split()


def test_excerpt_ends_at_a_sentence_or_a_word():
    text = "Refund policy: duplicates are refunded. Annual plans may be refunded pro rata within thirty days."
    assert excerpt(text) == text
    assert excerpt(text, limit=60) == "Refund policy: duplicates are refunded."
    assert excerpt("one two three four five", limit=12) == "one two ..."
    assert excerpt("a  b\n c") == "a b c"


def test_a_chunk_without_an_agent_is_the_task_or_a_tool():
    def envelope(kind, data):
        return {"body": {"stream_chunk": {"kind": kind, "data": data}}}

    assert speaker_of(envelope("data", {"agent_role": "Writer"})) == "Writer"
    assert speaker_of(envelope("data", {})) == "task"
    assert speaker_of(envelope("tool", {})) == "tool"
