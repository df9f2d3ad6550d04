"""Attack: take the audit hook's own frame from the traceback of a PermissionError it raised, and reprogram it through what that frame holds: closure cells of its helpers (scratch set to "", which every path starts with + "/"), mutable tables, its locals.
EXPECT: {"status": "ok", "error": null, "answer": "frames: 1, still blocked"}
"""


def run(task, llm, tools):
    tb = None
    try:
        open("/etc/hostname")
    except PermissionError as e:
        tb = e.__traceback__.tb_next  # past our own frame: the hook's
    frames = 0
    while tb is not None:
        frame, tb = tb.tb_frame, tb.tb_next
        frames += 1
        for name, value in list(frame.f_locals.items()):
            for cell in getattr(value, "__closure__", None) or ():
                if isinstance(cell.cell_contents, str):
                    cell.cell_contents = ""
                elif isinstance(cell.cell_contents, tuple):
                    cell.cell_contents = ("",)
            if isinstance(value, (dict, list, set)):
                value.clear()
            frame.f_locals[name] = "/"
    try:
        open("/etc/hostname").read()
        return f"frames: {frames}, read"
    except PermissionError as e:
        return f"frames: {frames}, " + ("still blocked" if "sandbox:" in str(e) else "kernel refused")
