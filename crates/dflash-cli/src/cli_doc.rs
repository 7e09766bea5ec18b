//! `docs/CLI.md`: every command's `--help`, generated from the clap definitions, so the
//! document cannot drift from the binary. The test `cli_doc_is_current` fails when it is out of
//! date; `DFLASH_BLESS=1 cargo test -p dflash-cli cli_doc` rewrites it.

use clap::Command;

/// Help text width in the document (the terminal's width would make it machine-dependent).
const WIDTH: usize = 100;

/// The whole document for the built command tree `root`.
pub fn markdown(root: &Command) -> String {
    let mut out = String::from(
        "# dflash-rs command line\n\nEvery command's `--help`, generated from the binary's \
         definitions (`DFLASH_BLESS=1 cargo test -p dflash-cli cli_doc` rewrites this file; a \
         test fails when it is out of date).\n",
    );
    section(root, root.get_name(), &mut out);
    out
}

/// One command's help under its full name, then its subcommands'.
fn section(cmd: &Command, path: &str, out: &mut String) {
    let help = cmd.clone().term_width(WIDTH).render_long_help().to_string();
    let help: Vec<&str> = help.lines().map(str::trim_end).collect();
    out.push_str(&format!(
        "\n## `{path}`\n\n```text\n{}\n```\n",
        help.join("\n").trim_end()
    ));
    for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
        section(sub, &format!("{path} {}", sub.get_name()), out);
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn cli_doc_is_current() {
        let mut root = crate::Cli::command();
        root.build();
        let doc = super::markdown(&root);
        let path = dflash_testkit::repo_root().join("docs/CLI.md");
        if dflash_core::env::BLESS.is_set() {
            std::fs::write(&path, &doc).unwrap();
            return;
        }
        let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            on_disk == doc,
            "docs/CLI.md is out of date: DFLASH_BLESS=1 cargo test -p dflash-cli cli_doc"
        );
        // the grouped commands are there
        for c in ["bench decode", "bench shape", "bench train", "check device"] {
            assert!(doc.contains(&format!("## `dflash-rs {c}`")), "{c}");
        }
    }
}
