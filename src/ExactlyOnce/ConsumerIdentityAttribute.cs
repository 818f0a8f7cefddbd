namespace ExactlyOnce;

/// <summary>
/// Gives a consumer class an explicit, stable identity: the scope of its inbox deduplication. Without it the
/// identity is the type's full name, so renaming the class (or moving its namespace) would reset deduplication.
/// </summary>
[AttributeUsage(AttributeTargets.Class, AllowMultiple = false, Inherited = false)]
public sealed class ConsumerIdentityAttribute : Attribute
{
    /// <summary>Creates the attribute with the consumer's stable name (at most 500 characters).</summary>
    public ConsumerIdentityAttribute(string name) => Name = name;

    /// <summary>The consumer's stable name, stored in <c>inbox_messages.consumer_type</c>.</summary>
    public string Name { get; }
}
