# Build the Windows installer of MoE Ferry: PyInstaller folder, smoke test, Inno Setup.
#
#   powershell -ExecutionPolicy Bypass -File packaging\windows\build.ps1 [-Python .venv\Scripts\python.exe]
#       [-Out build\windows] [-SkipInstaller]
#
# Run it from any folder; it works in the repository root. The Python must have MoE Ferry's
# dependencies and PyInstaller installed (packaging\README.md: the CUDA or CPU torch build is
# chosen there, the installer ships whichever is installed). Inno Setup 6.6+ must be installed
# (ISCC.exe found through -Iscc, $env:ISCC, PATH or the usual install folders).
# Result: <Out>\moeferry-<version>-windows-x64-setup.exe and its slices
# moeferry-<version>-windows-x64-setup-1.bin, -2.bin, ... (each at most 2,000,000,000 bytes).
# A CUDA build needs triton-windows in the venv (the fused kernels; it brings its own C compiler).

param(
    [string]$Python = "python",
    [string]$Out = "build\windows",
    [string]$Iscc = "",
    [switch]$SkipInstaller
)

$ErrorActionPreference = "Stop"
$Root = (Resolve-Path (Join-Path $PSScriptRoot "..\..")).Path
Set-Location $Root
if (-not [System.IO.Path]::IsPathRooted($Out)) { $Out = Join-Path $Root $Out }
New-Item -ItemType Directory -Force -Path $Out | Out-Null

$match = Select-String -Path (Join-Path $Root "pyproject.toml") -Pattern '^version\s*=\s*"([^"]+)"' | Select-Object -First 1
if (-not $match) { throw "No version = ""..."" line in pyproject.toml." }
$Version = $match.Matches[0].Groups[1].Value
$Numeric = ([regex]::Matches($Version, '\d+') | Select-Object -First 3 | ForEach-Object { $_.Value }) -join "."
Write-Host "MoE Ferry $Version"

& $Python -c "import torch, PyInstaller; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| PyInstaller', PyInstaller.__version__)"
if ($LASTEXITCODE) { throw "$Python lacks torch or PyInstaller: see packaging\README.md." }
$Cuda = "$(& $Python -c "import torch; print(torch.version.cuda or '')")".Trim()  # "" for a CPU build
# The oldest driver each CUDA runs on (NVIDIA's CUDA release notes, minor-version compatibility).
# (switch runs every clause that matches unless it breaks.)
$MinDriver = switch -Regex ($Cuda) {
    '^13\.' { 580; break }
    '^12\.(8|9)$' { 570; break }
    '^12\.' { 528; break }
    '^$' { 0; break }
    default { throw "Unknown CUDA version ${Cuda}; add its oldest driver to build.ps1." }
}
if ($Cuda) {
    & $Python -c "import triton"
    if ($LASTEXITCODE) { throw "A CUDA build needs Triton for its fused kernels: pip install ""triton-windows>=3.6,<3.7"" (for torch 2.11)." }
}

# 1. The one-folder app: <Out>\dist\moeferry\{moeferry.exe, moeferry-cli.exe, _internal\}
& $Python -m PyInstaller --noconfirm --clean --distpath "$Out\dist" --workpath "$Out\work" packaging\moeferry.spec
if ($LASTEXITCODE) { throw "PyInstaller failed (exit code $LASTEXITCODE)." }
$App = Join-Path $Out "dist\moeferry"

# 2. Smoke test through the console executable.
& "$App\moeferry-cli.exe" --help | Out-Host
if ($LASTEXITCODE) { throw "moeferry-cli.exe --help failed." }
& "$App\moeferry-cli.exe" demo --path | Out-Host
if ($LASTEXITCODE) { throw "moeferry-cli.exe demo --path failed." }
& "$App\moeferry-cli.exe" demo --selftest | Out-Host
if ($LASTEXITCODE) { throw "moeferry-cli.exe demo --selftest failed." }
$size = (Get-ChildItem $App -Recurse -File | Measure-Object -Property Length -Sum).Sum
Write-Host ("App folder: {0:N0} MB" -f ($size / 1MB))
if ($SkipInstaller) { exit 0 }

# 3. The installer.
if (-not $Iscc) { $Iscc = $env:ISCC }
if (-not $Iscc) {
    $cmd = Get-Command iscc.exe -ErrorAction SilentlyContinue
    if ($cmd) { $Iscc = $cmd.Source }
}
if (-not $Iscc) {
    $candidates = @(
        (Join-Path ${env:ProgramFiles(x86)} "Inno Setup 6\ISCC.exe"),
        (Join-Path $env:ProgramFiles "Inno Setup 6\ISCC.exe"),
        (Join-Path $env:LOCALAPPDATA "Programs\Inno Setup 6\ISCC.exe")
    )
    $Iscc = $candidates | Where-Object { $_ -and (Test-Path $_) } | Select-Object -First 1
}
if (-not $Iscc) { throw "ISCC.exe not found: install Inno Setup 6.6+ (winget install JRSoftware.InnoSetup) or pass -Iscc." }

$isccArgs = @("/DAppVersion=$Version", "/DAppVersionNumeric=$Numeric", "/DSourceDir=$App", "/O$Out",
              "/DMinNvidiaDriver=$MinDriver", "/DCudaVersion=$Cuda")
& $Iscc @isccArgs (Join-Path $Root "packaging\windows\installer.iss")
if ($LASTEXITCODE) { throw "ISCC failed (exit code $LASTEXITCODE)." }
Get-ChildItem $Out -Filter "moeferry-$Version-windows-x64-setup*" | ForEach-Object {
    Write-Host ("{0}  {1:N0} MB" -f $_.FullName, ($_.Length / 1MB))
}
