"""hopper_kernel/sync.py: the PTX pass that drops the partition barrier Triton puts before a marked
mbarrier wait, and nothing else."""

import pytest

sync = pytest.importorskip("pagedprefill.backends.triton.hopper_kernel.sync")

WAIT = """\t// begin inline asm
\t{
\t.reg .pred complete;
\twaitLoop:
\tmbarrier.try_wait.parity.shared.b64 complete, [%r928], %r895;
\t@!complete bra.uni waitLoop;
\t}
\t// end inline asm"""


def ptx(*between: str, mark: bool = True) -> str:
    head = [f"\tmov.b32 %r895, %r2350; // {sync.MARK}" if mark else "\tmov.b32 %r895, %r2350;", "\t// end inline asm"]
    return "\n".join(["\t.loc 6 431 28", *head, *between, WAIT, "\tshl.b32 %r963, %r3359, 13;"])


def test_the_barrier_between_a_mark_and_its_wait_is_dropped():
    src = ptx("\tadd.s32 %r928, %r962, 107904;", "\t.loc 6 401 46", "\tbar.sync \t3, 128;")
    out, n = sync.drop_marked_barriers(src)
    assert n == 1 and "bar.sync" not in out
    assert out == src.replace("\n\tbar.sync \t3, 128;", "")  # (every other line kept, in order)
    out, n = sync.drop_marked_barriers(src.replace("3, 128", "0, 256"))
    assert n == 1 and "bar.sync" not in out


@pytest.mark.parametrize(
    "between",
    [
        ("\tst.shared.b32 [%r1], %r2;", "\tbar.sync \t3, 128;"),  # (a write the barrier may order)
        ("\tbar.sync \t3, 128;", "\tld.shared.b32 %r5, [%r1];"),
        ("\tbar.sync \t3, 128;", "\tbar.sync \t2, 128;"),
        ("\tbar.sync \t3, 128;", "\twgmma.fence.sync.aligned;"),
        ("\t@%p1 bra $L__BB0_7;", "\tbar.sync \t3, 128;"),  # (another path joins before the wait)
    ],
)
def test_a_barrier_with_anything_but_index_arithmetic_beside_it_stays(between):
    src = ptx(*between)
    assert sync.drop_marked_barriers(src) == (src, 0)


def test_barriers_before_unmarked_waits_stay():
    src = ptx("\tbar.sync \t3, 128;", mark=False)
    assert sync.drop_marked_barriers(src) == (src, 0)
    two = ptx("\tbar.sync \t3, 128;") + "\n" + ptx("\tbar.sync \t3, 128;", mark=False)
    out, n = sync.drop_marked_barriers(two)
    assert n == 1 and out.count("bar.sync") == 1


def test_the_pass_is_chained_once_onto_tritons_stage_hook():
    from triton import knobs

    hook = knobs.runtime.add_stages_inspection_hook
    assert getattr(hook, "pagedprefill", False)
    sync.install()
    assert knobs.runtime.add_stages_inspection_hook is hook
    stages = {"ptx": lambda src, metadata: ptx("\tbar.sync \t3, 128;")}
    hook(None, stages, None, None, 90)
    assert "bar.sync" not in stages["ptx"](None, {})
