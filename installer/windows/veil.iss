; Inno Setup 6 script for Veil on Windows: per-user install (no administrator rights),
; Start-menu entry, optional desktop icon, uninstaller that keeps user data unless asked.
;
; Build on Windows from the repository root (inside the .venv):
;   python installer\build.py
; which freezes dist\veil with PyInstaller and then runs
;   ISCC /DAppVersion=0.1.0 /DBundleDir=dist\veil /DOutputDir=dist /DRepoRoot=. installer\windows\veil.iss
; Output: dist\Veil-VERSION-setup.exe
;
; Silent install:      Veil-0.1.0-setup.exe /VERYSILENT /CURRENTUSER
; Silent uninstall:    "%LOCALAPPDATA%\Programs\Veil\unins000.exe" /VERYSILENT          (keeps data)
;                      add /PURGEUSERDATA=1 to also delete %LOCALAPPDATA%\veil

#ifndef AppVersion
  #define AppVersion "0.1.0"
#endif
#ifndef RepoRoot
  #define RepoRoot "..\.."
#endif
#ifndef BundleDir
  #define BundleDir RepoRoot + "\dist\veil"
#endif
#ifndef OutputDir
  #define OutputDir RepoRoot + "\dist"
#endif

[Setup]
AppId={{F7D852B4-600B-4C59-B091-7E84210AC344}
AppName=Veil
AppVersion={#AppVersion}
AppVerName=Veil {#AppVersion}
AppPublisher=Veil team
AppComments=Private AI assistant: the model's ends run on this computer, only activations reach the server
; per-user: {autopf} is %LOCALAPPDATA%\Programs when no administrator rights are used
PrivilegesRequired=lowest
PrivilegesRequiredOverridesAllowed=commandline
DefaultDirName={autopf}\Veil
DefaultGroupName=Veil
DisableProgramGroupPage=yes
DisableDirPage=auto
UsePreviousAppDir=yes
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
MinVersion=10.0
OutputDir={#OutputDir}
OutputBaseFilename=Veil-{#AppVersion}-setup
SetupIconFile={#RepoRoot}\resources\icons\veil.ico
UninstallDisplayIcon={app}\veil.exe
UninstallDisplayName=Veil
WizardStyle=modern
; the bundle is about a gigabyte of mostly libraries: lzma2 solid, in a separate process
Compression=lzma2/normal
SolidCompression=yes
LZMAUseSeparateProcess=yes
DiskSpanning=no
CloseApplications=yes
RestartApplications=no

[Languages]
Name: "english"; MessagesFile: "compiler:Default.isl"

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked

[Files]
Source: "{#BundleDir}\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs
Source: "{#RepoRoot}\resources\icons\veil.ico"; DestDir: "{app}"; Flags: ignoreversion

[Icons]
Name: "{group}\Veil"; Filename: "{app}\veil.exe"; IconFilename: "{app}\veil.ico"; Comment: "Private AI assistant"
Name: "{group}\Uninstall Veil"; Filename: "{uninstallexe}"
Name: "{autodesktop}\Veil"; Filename: "{app}\veil.exe"; IconFilename: "{app}\veil.ico"; Tasks: desktopicon

[Run]
Filename: "{app}\veil.exe"; Description: "{cm:LaunchProgram,Veil}"; Flags: nowait postinstall skipifsilent

[UninstallDelete]
; byte-code caches Python may write inside the program folder (never user data)
Type: filesandordirs; Name: "{app}\_internal\__pycache__"

[Code]
// User data (chats, keys file if chosen, settings, model cache) lives in %LOCALAPPDATA%\veil.
// It is kept unless the user ticks "yes" here or passes /PURGEUSERDATA=1 to the uninstaller.
procedure CurUninstallStepChanged(CurUninstallStep: TUninstallStep);
var
  DataDir: String;
  Purge: Boolean;
begin
  if CurUninstallStep = usPostUninstall then
  begin
    DataDir := ExpandConstant('{localappdata}\veil');
    if not DirExists(DataDir) then
      Exit;
    Purge := ExpandConstant('{param:PURGEUSERDATA|0}') = '1';
    if (not Purge) and (not UninstallSilent) then
      Purge := MsgBox('Veil is removed.' + #13#10#13#10 +
        'Also delete your Veil data (chats, settings and the model cache) in ' + DataDir + '?' +
        #13#10 + 'Choose No to keep it for a later reinstall.',
        mbConfirmation, MB_YESNO or MB_DEFBUTTON2) = IDYES;
    if Purge then
      DelTree(DataDir, True, True, True);
  end;
end;
