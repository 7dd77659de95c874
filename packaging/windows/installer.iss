; Inno Setup script for MoE Ferry (Inno Setup 6.6 or later). Built by packaging\windows\build.ps1:
;
;   ISCC.exe /DAppVersion=0.1.0 /DSourceDir=C:\...\dist\moeferry /OC:\...\out packaging\windows\installer.iss
;
; SourceDir is the PyInstaller folder (dist\moeferry, with moeferry.exe, moeferry-cli.exe and
; _internal\). The installer is per-user and needs no administrator (Program Files is offered
; through the "install for all users" dialog). The user's data folder - chats, settings and
; downloaded models, %LOCALAPPDATA%\moeferry (platformdirs' user data dir "moeferry") - is kept
; by the uninstaller unless the user ticks the box that deletes it.

#if Ver < EncodeVer(6, 6, 0)
  #error Inno Setup 6.6 or later is needed (CreateCustomForm's signature changed in 6.6.0)
#endif

#define AppName "MoE Ferry"
#define AppExeName "moeferry.exe"
#define AppCliName "moeferry-cli.exe"
#define DataFolderName "moeferry"
#ifndef AppVersion
  ; build.ps1 passes the version read from pyproject.toml; tests/packaging/test_packaging.py keeps this
  ; fallback equal to it.
  #define AppVersion "0.1.0"
#endif
#ifndef AppVersionNumeric
  ; VersionInfoVersion takes digits only (0.2.0rc1 -> 0.2.0); build.ps1 passes it.
  #define AppVersionNumeric AppVersion
#endif
#ifndef SourceDir
  #define SourceDir "..\..\build\windows\dist\moeferry"
#endif
#ifndef MinNvidiaDriver
  ; The oldest NVIDIA driver the bundled torch's CUDA runs on; build.ps1 passes it from
  ; torch.version.cuda (CUDA 13.x: 580, 12.8: 570). 0: a CPU-only build, nothing to check.
  #define MinNvidiaDriver "0"
#endif
#ifndef CudaVersion
  #define CudaVersion ""
#endif

[Setup]
AppId={{BFA7CBFA-B203-47C6-8AF9-58027CD6B05F}
AppName={#AppName}
AppVersion={#AppVersion}
AppVerName={#AppName} {#AppVersion}
AppPublisher={#AppName}
VersionInfoVersion={#AppVersionNumeric}
VersionInfoProductName={#AppName}
; Short: Windows paths stop at 260 characters unless long paths are enabled, and the deepest
; file of the app folder is about 110 characters below it (packaging/check_bundle.py).
DefaultDirName={autopf}\MoEFerry
DefaultGroupName={#AppName}
DisableProgramGroupPage=yes
PrivilegesRequired=lowest
PrivilegesRequiredOverridesAllowed=dialog commandline
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
MinVersion=10.0
OutputBaseFilename=moeferry-{#AppVersion}-windows-x64-setup
SetupIconFile={#SourceDir}\_internal\moeferry\resources\icons\moeferry.ico
UninstallDisplayIcon={app}\{#AppExeName}
UninstallDisplayName={#AppName} {#AppVersion}
WizardStyle=modern
ChangesEnvironment=yes
CloseApplications=yes
; The CUDA build of torch makes the folder 4-5 GB. Solid LZMA over that needs many GB of RAM
; and gains little on already compressed CUDA libraries, so compress file by file.
Compression=lzma2/normal
SolidCompression=no
LZMAUseSeparateProcess=yes
; Always sliced: Setup.exe plus Setup-N.bin files of at most 2,000,000,000 bytes each (1.86
; GiB), under the 2 GiB that release hosts allow per file. Keep them in one folder to install.
DiskSpanning=yes
DiskSliceSize=2000000000

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked
Name: "addtopath"; Description: "Add the folder with moeferry-cli.exe (the command-line program) to my PATH"; GroupDescription: "Command line:"; Flags: unchecked; Check: not IsAdminInstallMode

[InstallDelete]
; An update must not mix the libraries of two builds (a torch update renames many DLLs).
Type: filesandordirs; Name: "{app}\_internal"

[Files]
Source: "{#SourceDir}\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{autoprograms}\{#AppName}"; Filename: "{app}\{#AppExeName}"; WorkingDir: "{app}"
Name: "{autodesktop}\{#AppName}"; Filename: "{app}\{#AppExeName}"; WorkingDir: "{app}"; Tasks: desktopicon

[Run]
Filename: "{app}\{#AppExeName}"; Description: "{cm:LaunchProgram,{#AppName}}"; Flags: nowait postinstall skipifsilent

[UninstallDelete]
; Bytecode that Python writes next to the modules shipped as source (Triton's) at run time.
Type: filesandordirs; Name: "{app}\_internal"

[Code]
var
  DeleteUserData: Boolean;

{ --- Install: what the bundled torch needs from the machine --- }

function VCRuntimeInstalled(): Boolean;
var
  Installed: Cardinal;
begin
  { torch's DLLs link the Visual C++ 2015-2022 runtime (msvcp140.dll, vcruntime140_1.dll). }
  Result := RegQueryDWordValue(HKLM64, 'SOFTWARE\Microsoft\VisualStudio\14.0\VC\Runtimes\x64',
    'Installed', Installed) and (Installed = 1);
end;

function NvidiaDriverVersion(): String;
var
  ResultCode: Integer;
  Output: TExecOutput;
begin
  { nvidia-smi comes with every current NVIDIA driver, in System32; '' when there is none. }
  Result := '';
  if ExecAndCaptureOutput(ExpandConstant('{sys}\nvidia-smi.exe'),
      '--query-gpu=driver_version --format=csv,noheader', '', SW_HIDE, ewWaitUntilTerminated,
      ResultCode, Output) and (ResultCode = 0) and (GetArrayLength(Output.StdOut) > 0) then
    Result := Trim(Output.StdOut[0]);
end;

function DriverMajor(const Version: String): Integer;
var
  Dot: Integer;
begin
  Dot := Pos('.', Version);
  if Dot = 0 then
    Dot := Length(Version) + 1;
  Result := StrToIntDef(Copy(Version, 1, Dot - 1), 0);
end;

function MachineProblems(): String;
var
  Driver: String;
begin
  Result := '';
  if not VCRuntimeInstalled() then
    Result := 'The Microsoft Visual C++ 2015-2022 Redistributable (x64), which PyTorch needs, is ' +
      'not installed. Install it from https://aka.ms/vs/17/release/vc_redist.x64.exe before ' +
      'you start MoE Ferry.' + #13#10#13#10;
  if {#MinNvidiaDriver} > 0 then
  begin
    Driver := NvidiaDriverVersion();
    if Driver = '' then
      Result := Result + 'No NVIDIA driver was found, so MoE Ferry will run only on the CPU ' +
        '(the small demo model). Mixtral needs an NVIDIA GPU with driver {#MinNvidiaDriver} or later.' + #13#10#13#10
    else if DriverMajor(Driver) < {#MinNvidiaDriver} then
      Result := Result + 'The NVIDIA driver is version ' + Driver + ', but this build (CUDA ' +
        '{#CudaVersion}) needs {#MinNvidiaDriver} or later; until you update it from ' +
        'https://www.nvidia.com/drivers MoE Ferry runs on the CPU only.' + #13#10#13#10;
  end;
end;

function InitializeSetup(): Boolean;
var
  Problems: String;
begin
  Problems := MachineProblems();
  Result := (Problems = '') or
    (SuppressibleMsgBox(Problems + 'Install MoE Ferry anyway?', mbConfirmation, MB_YESNO, IDYES) = IDYES);
end;

function UserDataDir(): String;
begin
  Result := ExpandConstant('{localappdata}\{#DataFolderName}');
end;

{ --- PATH (per-user installs only: HKCU\Environment) --- }

function PathHas(const Paths, Dir: String): Boolean;
begin
  Result := Pos(';' + Uppercase(Dir) + ';', ';' + Uppercase(Paths) + ';') > 0;
end;

procedure AddToUserPath(const Dir: String);
var
  Paths: String;
begin
  if not RegQueryStringValue(HKCU, 'Environment', 'Path', Paths) then
    Paths := '';
  if PathHas(Paths, Dir) then
    Exit;
  if (Paths <> '') and (Copy(Paths, Length(Paths), 1) <> ';') then
    Paths := Paths + ';';
  RegWriteExpandStringValue(HKCU, 'Environment', 'Path', Paths + Dir);
end;

procedure RemoveFromUserPath(const Dir: String);
var
  Paths: String;
  P: Integer;
begin
  if not RegQueryStringValue(HKCU, 'Environment', 'Path', Paths) then
    Exit;
  Paths := ';' + Paths + ';';
  P := Pos(';' + Uppercase(Dir) + ';', Uppercase(Paths));
  if P = 0 then
    Exit;
  Delete(Paths, P, Length(Dir) + 1);
  { strip the guard semicolons added above }
  Paths := Copy(Paths, 2, Length(Paths) - 2);
  RegWriteExpandStringValue(HKCU, 'Environment', 'Path', Paths);
end;

procedure CurStepChanged(CurStep: TSetupStep);
begin
  if (CurStep = ssPostInstall) and WizardIsTaskSelected('addtopath') then
    AddToUserPath(ExpandConstant('{app}'));
end;

{ --- Uninstall: a checkbox, unticked, for deleting the user's data --- }

function InitializeUninstall(): Boolean;
var
  Form: TSetupForm;
  Note: TNewStaticText;
  Box: TNewCheckBox;
  OkButton, CancelButton: TNewButton;
begin
  Result := True;
  DeleteUserData := False;
  if UninstallSilent or not DirExists(UserDataDir()) then
    Exit;  { silent uninstall: the data stays }

  Form := CreateCustomForm(ScaleX(460), ScaleY(170), False, False);
  try
    Form.Caption := 'Uninstall {#AppName}';
    Form.Position := poScreenCenter;

    Note := TNewStaticText.Create(Form);
    Note.Parent := Form;
    Note.AutoSize := False;
    Note.WordWrap := True;
    Note.SetBounds(ScaleX(16), ScaleY(16), Form.ClientWidth - ScaleX(32), ScaleY(64));
    Note.Caption := 'Your chats, settings and downloaded models are in ' + UserDataDir() +
      '. They are kept, so that a new installation finds them again, unless you tick the box.';

    Box := TNewCheckBox.Create(Form);
    Box.Parent := Form;
    Box.SetBounds(ScaleX(16), ScaleY(88), Form.ClientWidth - ScaleX(32), ScaleY(20));
    Box.Caption := 'Also delete my chats, settings and downloaded models';
    Box.Checked := False;

    OkButton := TNewButton.Create(Form);
    OkButton.Parent := Form;
    OkButton.SetBounds(Form.ClientWidth - ScaleX(16 + 90 + 8 + 90), Form.ClientHeight - ScaleY(16 + 25),
      ScaleX(90), ScaleY(25));
    OkButton.Caption := 'Uninstall';
    OkButton.ModalResult := mrOk;
    OkButton.Default := True;

    CancelButton := TNewButton.Create(Form);
    CancelButton.Parent := Form;
    CancelButton.SetBounds(Form.ClientWidth - ScaleX(16 + 90), Form.ClientHeight - ScaleY(16 + 25),
      ScaleX(90), ScaleY(25));
    CancelButton.Caption := 'Cancel';
    CancelButton.ModalResult := mrCancel;
    CancelButton.Cancel := True;

    Result := Form.ShowModal() = mrOk;
    DeleteUserData := Result and Box.Checked;
  finally
    Form.Free();
  end;
end;

procedure CurUninstallStepChanged(CurUninstallStep: TUninstallStep);
begin
  if CurUninstallStep = usUninstall then
    RemoveFromUserPath(ExpandConstant('{app}'));
  if (CurUninstallStep = usPostUninstall) and DeleteUserData then
    DelTree(UserDataDir(), True, True, True);
end;
