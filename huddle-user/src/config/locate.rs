//! Where in the config file a field is. Validation errors start with the
//! field's path (`service[0].backends[1].weight: ...`); this finds the
//! line of that field's value in the file's text, so the error names the
//! line too, as a syntax error does.

use std::{path::PathBuf, sync::Arc};
use toml_edit::{ImDocument, Item, Table, Value};

/// Where a configuration came from: a file's path and text, and the
/// fields command-line flags set over it. Kept in the validated config
/// too, so the checks against the host (a backend with no route) name
/// the file's line as validation does.
#[derive(Clone, Default)]
pub struct Origin {
    pub path: PathBuf,
    pub text: Arc<str>,
    /// Paths such as `huddle.tick_ms`, or `service[2]` for `--vip`.
    pub from_flags: Vec<String>,
}

impl Origin {
    /// The line in the file of the field error `e` starts with.
    #[must_use]
    pub fn line(&self, e: &anyhow::Error) -> Option<usize> {
        line_of(&self.text, &format!("{e:#}"), &self.from_flags)
    }

    /// `e`, a check's error about a field, with the file and its line
    /// when the file set the field.
    #[must_use]
    pub fn place(&self, e: anyhow::Error) -> anyhow::Error {
        match self.line(&e) {
            Some(n) => e.context(format!("config {}: line {n}", self.path.display())),
            None => e,
        }
    }
}

impl std::fmt::Debug for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Origin({})", self.path.display())
    }
}

/// The 1-based line of the field whose path starts `message` (up to its
/// first ": "), in TOML `text`: its value's line, or that of the deepest
/// part of the path the file has (a `[[service]]` header for a key left
/// out of it). `None` when the message starts with no path, when the file
/// has not even the path's first part or lacks an element it indexes
/// (a service added by `--vip`), or when a command-line flag
/// (`from_flags`, paths such as `huddle.tick_ms`) set the field.
pub fn line_of(text: &str, message: &str, from_flags: &[String]) -> Option<usize> {
    let path = message.split(": ").next()?;
    if path.is_empty()
        || !path
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '[' | ']'))
        || from_flags.iter().any(|f| within(path, f))
    {
        return None;
    }
    let doc = ImDocument::parse(text).ok()?;
    let mut node = Node::Table(doc.as_table());
    let mut at = None;
    for step in steps(path)? {
        let Some(next) = node.step(step) else {
            // A key left out: its table's line. An element the file does
            // not have (a service a flag added): none of the file's.
            if matches!(step, Step::Index(_)) {
                return None;
            }
            break;
        };
        node = next;
        at = node.span().map(|s| s.start).or(at);
    }
    at.map(|start| line_at(text, start))
}

/// The 1-based line of byte `offset` of `text`.
pub fn line_at(text: &str, offset: usize) -> usize {
    text.as_bytes()[..offset.min(text.len())]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// Whether `path` is `field` or lies under it.
fn within(path: &str, field: &str) -> bool {
    path.strip_prefix(field)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
}

/// One step down a path: a key, or an index into an array.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Step<'a> {
    Key(&'a str),
    Index(usize),
}

/// `service[0].backends[1]` as its steps; `None` if it is not a path.
fn steps(path: &str) -> Option<Vec<Step<'_>>> {
    let mut out = Vec::new();
    for part in path.split('.') {
        let (key, mut rest) = part.split_at(part.find('[').unwrap_or(part.len()));
        if key.is_empty() {
            return None;
        }
        out.push(Step::Key(key));
        while !rest.is_empty() {
            let close = rest.find(']')?;
            out.push(Step::Index(rest.get(1..close)?.parse().ok()?));
            rest = &rest[close + 1..];
            if !rest.is_empty() && !rest.starts_with('[') {
                return None;
            }
        }
    }
    Some(out)
}

/// A place in the parsed file.
#[derive(Clone, Copy)]
enum Node<'a> {
    Item(&'a Item),
    Table(&'a Table),
    Value(&'a Value),
}

impl<'a> Node<'a> {
    fn step(self, step: Step<'_>) -> Option<Node<'a>> {
        match (self, step) {
            (Node::Table(t), Step::Key(k)) => t.get(k).map(Node::Item),
            (Node::Item(Item::Table(t)), Step::Key(k)) => t.get(k).map(Node::Item),
            (Node::Item(Item::ArrayOfTables(a)), Step::Index(i)) => a.get(i).map(Node::Table),
            (Node::Item(Item::Value(v)), step) | (Node::Value(v), step) => match (v, step) {
                (Value::InlineTable(t), Step::Key(k)) => t.get(k).map(Node::Value),
                (Value::Array(a), Step::Index(i)) => a.get(i).map(Node::Value),
                _ => None,
            },
            _ => None,
        }
    }

    fn span(self) -> Option<std::ops::Range<usize>> {
        match self {
            Node::Item(i) => i.span(),
            Node::Table(t) => t.span(),
            Node::Value(v) => v.span(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "interface = \"eth0\"\n\
        [huddle]\n\
        tick_ms = 0\n\
        \n\
        [[service]]\n\
        vip = \"10.0.100.1:80/tcp\"\n\
        backends = [\"10.0.0.11:8080\"]\n\
        \n\
        [[service]]\n\
        vip = \"10.0.100.2:80/tcp\"\n\
        backends = [\n\
            \"10.0.0.11:8080\",\n\
            { addr = \"10.0.0.12:8080\", weight = -1 },\n\
        ]\n";

    #[test]
    fn a_fields_value_gives_its_line() {
        let at = |m: &str| line_of(FILE, m, &[]);
        assert_eq!(at("interface: bad"), Some(1));
        assert_eq!(at("huddle.tick_ms: 0 is outside 10..=60000"), Some(3));
        assert_eq!(at("service[1].vip: \"10.0.100.2:80\": x"), Some(10));
        assert_eq!(at("service[1].backends[1].weight: -1 must be"), Some(13));
        assert_eq!(at("service[1].backends[0]: listed twice"), Some(12));
    }

    #[test]
    fn a_field_left_out_gives_its_tables_line_or_none() {
        let at = |m: &str| line_of(FILE, m, &[]);
        assert_eq!(at("service[0].mode: x"), Some(5));
        assert_eq!(at("nat_ports: x"), None);
        assert_eq!(at("service[2].vip: from --vip"), None);
        assert_eq!(at("--backend given without --vip"), None);
    }

    #[test]
    fn a_field_a_flag_set_names_no_line_of_the_file() {
        assert_eq!(line_of(FILE, "interface: bad", &["interface".into()]), None);
        assert_eq!(
            line_of(FILE, "huddle.tick_ms: 0", &["huddle.tick_ms".into()]),
            None
        );
        assert_eq!(
            line_of(FILE, "huddle.tick_ms: 0", &["huddle.tick".into()]),
            Some(3)
        );
    }

    #[test]
    fn paths_parse_or_are_refused() {
        assert_eq!(
            steps("service[0].backends[1]"),
            Some(vec![
                Step::Key("service"),
                Step::Index(0),
                Step::Key("backends"),
                Step::Index(1)
            ])
        );
        assert_eq!(steps("a[x]"), None);
        assert_eq!(steps("a[0]b"), None);
        assert_eq!(steps(".a"), None);
    }
}
